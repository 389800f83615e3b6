"""launch/busy_check.py (make busy-check): its loop and table, with a stand-in for batch.py
that takes no time, so that this test is cheap; `make busy-check` runs the real chapters."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("busy_check", ROOT / "launch" / "busy_check.py")
busy_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(busy_check)

FAKE_BATCH = """
import json, pathlib, sys
args = sys.argv[1:]
out, chapter = pathlib.Path(args[args.index("--out") + 1]), args[-1]
status = "failed: AssertionError: too slow" if chapter == "bad" else "ok"
(out / "batch.json").write_text(json.dumps({"runs": [{"status": status}]}))
sys.exit(status != "ok")
"""


def test_runs_each_chapter_beside_another_and_tables_the_failures(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake_batch.py"
    fake.write_text(FAKE_BATCH)
    monkeypatch.setattr(busy_check, "BATCH", fake)
    monkeypatch.setattr(busy_check, "SETTLE_S", 1)  # the run beside (a stand-in: 0.1 s) ends at least once
    code = busy_check.main(["--repeats", "2", "--out", str(tmp_path / "out"), "07", "bad"])
    assert code == 1
    runs = json.loads((tmp_path / "out" / "busy_check.json").read_text())["runs"]
    assert [(r["chapter"], r["run"], r["beside"]) for r in runs] == [
        ("07", 1, "bad"),
        ("07", 2, "bad"),
        ("bad", 1, "07"),
        ("bad", 2, "07"),
    ]
    assert [r["status"] == "ok" for r in runs] == [True, True, False, False]
    table = capsys.readouterr().out
    assert "bad           0      2   failed: AssertionError: too slow" in table and table.rstrip().splitlines()[
        -1
    ].startswith("FAIL")
    # the run beside that failed is named with its own folder, kept (a later run does not overwrite its log)
    said = next(line for line in table.splitlines() if "(bad ran" in line)
    failed = said.split(" failed: ")[1].rstrip(")").split(", ")
    assert failed and all((pathlib.Path(f) / "batch.json").is_file() for f in failed), said
    assert len(set(failed)) == len(failed) and said.startswith(f"     (bad ran {len(failed)} time(s)"), said


def test_all_passing_exits_zero(tmp_path, monkeypatch):
    fake = tmp_path / "fake_batch.py"
    fake.write_text(FAKE_BATCH)
    monkeypatch.setattr(busy_check, "BATCH", fake)
    monkeypatch.setattr(busy_check, "SETTLE_S", 0)
    assert busy_check.main(["--repeats", "1", "--out", str(tmp_path / "out"), "07"]) == 0
