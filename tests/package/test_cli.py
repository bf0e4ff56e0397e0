"""`adacc-hf plan`: profiles, solves, prints and writes the policy; bad input is one clear line."""

from __future__ import annotations

import pytest

from adacc_hf import Policy
from adacc_hf.cli import main


def test_plan_writes_a_policy_for_the_budget(tmp_path, capsys):
    out = tmp_path / "policy.json"
    rc = main(
        [
            "plan",
            "--config",
            "tiny-llama",
            "--batch-size",
            "8",
            "--seq-len",
            "64",
            "--budget",
            "8MiB",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--profile-out",
            str(tmp_path / "profile.json"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted: activations held" in text and "input_layernorm" in text
    assert text.index("profiling 8 x 64") < text.index("profiled")  # said before it starts
    window = next(line for line in text.splitlines() if line.startswith("budget 8.00 MiB;"))
    assert "least" in window and "no checkpointing" in window and "of the way" in window
    policy = Policy.load(str(out))
    assert policy.model_type == "llama" and policy.metadata["source"] == "milp"
    assert (tmp_path / "profile.json").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "tiny-llama", "--budget", "20 parsecs"], "bad memory budget"),
        (["--config", "opt", "--budget", "1GiB"], "unknown --config 'opt'"),
        (
            [
                "--config",
                "tiny-llama",
                "--budget",
                "1KiB",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--repeats",
                "1",
            ],
            "smallest feasible budget",
        ),
        (["--budget", "1GiB"], "exactly one of --model"),
        (["--model", "/nonexistent", "--budget", "1GiB"], "not a local model directory"),
    ],
)
def test_plan_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
