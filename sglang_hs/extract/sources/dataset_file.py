"""--data as a source: the records of a JSON Lines file or Hugging Face dataset this run takes, in file order,
each (index, record) with the index it has in the whole file (so --shard outputs merge and --resume finds the
same samples); and the preparer that turns a record into a Sample for the server's model."""
from __future__ import annotations

import os
from typing import Iterator, Optional, Tuple

from sglang_hs.extract.dataset import read_records, record_place
from sglang_hs.extract.samples import make_preparer
from sglang_hs.extract.selection import Selection


class DatasetSource:
    def __init__(self, path: str, selection: Selection, max_samples: Optional[int] = None) -> None:
        self.path, self.selection, self.max_samples = path, selection, max_samples

    def __iter__(self) -> Iterator[Tuple[int, object]]:
        for index, record in read_records(self.path):
            if self.max_samples is not None and index >= self.max_samples:
                break
            if self.selection.takes(index):
                yield index, record

    def total(self) -> Optional[int]:
        """How many records this run takes, when the data is a file (None: a dataset, not counted first)."""
        if not os.path.isfile(self.path):
            return None
        with open(self.path, "rb") as f:
            n = sum(1 for line in f if line.strip())
        n = min(n, self.max_samples if self.max_samples is not None else n)
        return sum(self.selection.takes(i) for i in range(n))

    def place(self, index: int) -> Tuple[str, dict]:
        """Where record `index` is: in words for a message, and as manifest.json lists a skipped record."""
        where = {"sample": index, **({"line": index + 1} if os.path.isfile(self.path) else {})}
        return f"sample {index} ({record_place(self.path, index)})", where


def model_side(requests, manifest: dict, url: Optional[str] = None):
    """The sample preparer for the server of `manifest` (its tokenizer, its limits; `requests`:
    config.RequestSettings) and, for --verify, the lm_head weight it is checked with."""
    preparer = make_preparer(manifest, regenerate=requests.regenerate, max_new_tokens=requests.max_new_tokens,
                             url=url)
    lm_head = None
    if requests.verify:
        from sglang_hs.extract.verify import load_lm_head

        lm_head = load_lm_head(manifest["model_path"])
    return preparer, lm_head
