"""Every Python snippet of README.md runs as written (on a CPU), so README cannot drift from the
API. The names a snippet leaves to the reader (`model`, `train`, `tokenizer`, `loader`) are a tiny
LLaMA and a few rows; the snippet's own text is executed unchanged, from README.md itself. Each
run must also do what the snippet says: Adacc planned the run (and, under an ``Accelerator``'s
bf16, planned under bf16 with no adacc warning)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from adacc_hf import assets

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPETS = [
    (README.read_text()[: m.start()].count("\n") + 2, m.group(1))
    for m in re.finditer(r"```python\n(.*?)```", README.read_text(), re.S)
]


def _rows(n: int = 8, length: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 250, (length,), generator=g) for _ in range(n)]
    return [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids
    ]


def _names(code: str) -> dict:
    """What the snippet takes as given."""
    model = assets.tiny_model("llama", vocab_size=256, num_hidden_layers=2)
    if "SFTTrainer" in code:
        pytest.importorskip("trl")
        from test_trl import texts, tokenizer

        return {"model": model, "train": texts(8), "tokenizer": tokenizer()}
    import datasets

    rows = _rows()
    train = datasets.Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]})
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    return {"model": model, "train": train, "loader": loader}


def test_the_readme_has_its_three_ways_of_use():
    code = "\n".join(c for _, c in SNIPPETS)
    for name in ("AdaccTrainingArguments", "AdaccCallback", "SFTTrainer", "adacc_hf.prepare"):
        assert name in code


#: TRL's snippet plans its ``max_length`` (8 x 1024) before the first step, beside TRL's own
#: [tokens, 32768] fp32 LM-head buffer: minutes on the 2-core CPU (`make test-all` runs it).
PARAMS = [
    pytest.param(n, c, id=f"README.md:{n}", marks=[pytest.mark.slow] if "SFTTrainer" in c else [])
    for n, c in SNIPPETS
]


@pytest.mark.parametrize("line,code", PARAMS)
def test_a_readme_snippet_runs_as_written(line, code, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    from accelerate.state import AcceleratorState

    names = _names(code)
    AcceleratorState._reset_state(True)  # a fresh process's: each snippet makes its own
    try:
        with caplog.at_level(logging.INFO, logger="adacc_hf"):
            exec(compile(code, f"README.md:{line}", "exec"), names)
    finally:
        AcceleratorState._reset_state(True)
    plans = [r for r in caplog.records if r.getMessage().startswith("adacc plan")]
    assert plans, caplog.text  # Adacc planned the run
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "adacc" in w.lower()], warnings
    if "Accelerator(mixed_precision" in code:
        session = names["session"]
        assert session.autocast == torch.bfloat16
        assert session.current.profile.autocast == str(torch.bfloat16)  # traced under bf16
