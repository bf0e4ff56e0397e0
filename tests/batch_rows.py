"""`Rows`: a tiny batch as a map-style dataset for Trainer tests."""

from __future__ import annotations

import torch


class Rows(torch.utils.data.Dataset):
    """The rows of one batch, `repeat` times over: every step trains on them (in some order), so
    the padding pattern a policy was solved for holds and the loss falls fast."""

    def __init__(self, batch, repeat=8):
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
        self.repeat = repeat

    def __len__(self):
        return len(self.rows) * self.repeat

    def __getitem__(self, i):
        return self.rows[i % len(self.rows)]
