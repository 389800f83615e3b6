"""results/ records: provenance is required, files are named by kind and device, and found again."""

from __future__ import annotations

import pytest

from ultrascale import records


def test_a_record_round_trips_under_its_kind_and_device(tmp_path):
    record = dict(records.provenance("NVIDIA H100 80GB HBM3"), rows=[1, 2])
    path = records.write("fp8", record, tmp_path)
    assert path.name == "fp8_nvidia_h100_80gb_hbm3.json"
    records.write("kernels", dict(record, device="NVIDIA H200"), tmp_path)
    found = records.recorded("fp8", tmp_path)
    assert [(p.name, r["rows"]) for p, r in found] == [("fp8_nvidia_h100_80gb_hbm3.json", [1, 2])]
    line = records.label(found[0][1], found[0][0])
    assert line.startswith("RECORDED on NVIDIA H100 80GB HBM3 (torch ")
    assert "from results/fp8_nvidia_h100_80gb_hbm3.json, not measured on this machine" in line


def test_a_record_without_provenance_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"needs its provenance; missing \['commit', 'date', 'torch'\]"):
        records.write("fp8", {"device": "X", "rows": []}, tmp_path)


def test_the_commit_comes_from_the_launcher_first_then_from_git(monkeypatch):
    monkeypatch.delenv("ULTRASCALE_COMMIT", raising=False)
    commit = records.git_commit()
    assert len(commit.removesuffix("-dirty")) == 40
    monkeypatch.setenv("ULTRASCALE_COMMIT", "abc123")  # a copied .git may be stale: the launcher wins
    assert records.git_commit() == "abc123"
    monkeypatch.delenv("ULTRASCALE_COMMIT")
    monkeypatch.setattr(records, "ROOT", records.ROOT / "no-such-folder")  # git cannot run there
    assert records.git_commit() == "unknown"
