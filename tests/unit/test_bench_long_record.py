"""benchmarks/bench_long_record.py at a small size: it runs the whole-record path (finish worker -> ring ->
reader process -> SpecForge file) for every reader way, writes its CSVs, and its peak-memory figures show what
it measures: the reader holds the record's ring pages (views) or a copy of it besides (copy), or about two chunks
of them (chunked: the CLI with --part-mb; spill: the live dataset's long records; parts: the record published in
parts through a ring of a few parts, read the chunked way)."""
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_long_record  # noqa: E402

TOKENS = 2048  # 117 MB of DeepSeek-V3 rows
PART_MB = 8


def test_small_run_writes_its_figures(tmp_path):
    assert bench_long_record.main(["--out", str(tmp_path), "--tokens", str(TOKENS), "--reps", "1", "--slots", "512",
                                   "--disk-dir", str(tmp_path), "--part-mb", str(PART_MB)]) == 0
    with open(tmp_path / "bench_long_record_summary.csv") as f:
        rows = {r["reader"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"view", "chunked", "spill", "copy", "parts"}
    record = TOKENS * bench_long_record.ROW_BYTES / 1e9
    part = PART_MB * (1 << 20) / 1e9
    for way, r in rows.items():
        print(way, {k: v for k, v in r.items() if "median" in k or "vs" in k})
        assert float(r["record_GB"]) == record and float(r["e2e_GBps_median"]) > 0
        if way in ("view", "copy"):
            assert float(r["consumer_shmem_GB_median"]) >= record  # the ring pages of the whole record
        else:  # a chunk's pages and the next one's fault-around, the ring's header page
            assert float(r["consumer_shmem_GB_median"]) <= 2 * part, (way, r["consumer_shmem_GB_median"])
            # spill: a chunk's aux rows and final states made contiguous for the file, kept in the heap for the next
            assert float(r["consumer_anon_GB_median"]) < float(rows["view"]["consumer_anon_GB_median"]) + 4 * part
    assert float(rows["copy"]["consumer_anon_GB_median"]) - float(rows["view"]["consumer_anon_GB_median"]) > record / 2
    # records in parts: the ring holds a few parts, not the record (the others' ring is one record)
    assert float(rows["parts"]["ring_GB"]) < 5 * part < record <= float(rows["view"]["ring_GB"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".bench-long-record-")]  # its files removed
