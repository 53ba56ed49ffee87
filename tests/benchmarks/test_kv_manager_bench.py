import json
from pathlib import Path

from benchmarks.kv_manager import LAYOUTS, main


def test_kv_manager_bench_writes_rows_for_every_layout_and_mode(tmp_path: Path) -> None:
    output = tmp_path / "out" / "kv_manager.json"
    main(
        [
            "--num-requests", "40",
            "--prompt-len", "256",
            "--prefix-len", "128",
            "--output", str(output),
        ]
    )
    result = json.loads(output.read_text())

    rows = result["rows"]
    assert len(rows) == 6
    assert {(r["config"], r["prefix_caching"]) for r in rows} == {
        (layout.name, caching) for layout in LAYOUTS for caching in (True, False)
    }
    for row in rows:
        assert 0 < row["min_us"] <= row["p50_us"] <= row["p99_us"] <= row["max_us"]
        assert row["mean_us"] > 0
        if row["prefix_caching"]:
            assert 0 < row["hit_rate"] < 1, row
        else:
            assert row["hit_rate"] == 0, row
    by_name = {r["config"]: r for r in rows if r["prefix_caching"]}
    assert by_name["1 group (full attention)"]["num_groups"] == 1
    # Mamba's page raises attention's block size above the configured 16.
    assert by_name["full+sliding+Mamba"]["block_sizes"][0] > 16
    assert result["parameters"]["num_requests"] == 40
