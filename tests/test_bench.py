"""CPU tests of the benchmark harness (flashqla/bench.py): case lists, FLOP model, record schema, rendering."""
import json
import math
import os
import re
from pathlib import Path

import pytest

from flashqla import bench

SHARED = [Path(os.environ["FLASHQLA_SHARED"])] if os.environ.get("FLASHQLA_SHARED") else []
SHARED += [Path(__file__).resolve().parents[1] / "shared", Path("/work/shared")]


@pytest.fixture(autouse=True)
def _no_out_dir(monkeypatch):
    """The harness copies records to $OUT (the H200 run sets it): keep test records out of it."""
    monkeypatch.delenv("OUT", raising=False)


def _shared(rel):
    for root in SHARED:
        if (root / rel).is_file():
            return (root / rel).read_text()
    return None


# ----------------------------------------------------------------------------- case lists
def test_anchor_cases():
    fwd = bench.cases_for("anchors", bwd=False)
    bwd = bench.cases_for("anchors", fwd=False)
    assert len(fwd) == 24 and len(bwd) == 4
    assert bench.cases_for("anchors") == fwd + bwd
    assert {(c.model, c.name) for c in fwd if c.model.startswith("TP1")} == {
        ("TP1 (16/64)", "1x32768"), ("TP1 (16/64)", "1x8192"), ("TP1 (16/64)", "8192x4")}
    by = {(c.model, c.name): c for c in bwd}
    assert by[("hk16_hv32", "8k_4seq")].seqlens == (2048, 3000, 1000, 2144)
    assert by[("hk4_hv8", "32k_1seq")].seqlens == (32768,)
    assert (by[("hk4_hv8", "32k_1seq")].h_qk, by[("hk4_hv8", "32k_1seq")].h_v) == (4, 8)
    for c in fwd:
        assert c.h_v % c.h_qk == 0 and c.direction == "fwd"
        assert f"({c.h_qk}/{c.h_v})" in c.model
    tp8 = {c.name: c.seqlens for c in fwd if c.model.startswith("TP8")}
    assert tp8["28672+4096"] == (28672, 4096) and tp8["8192x4"] == (8192,) * 4 and tp8["1024x8"] == (1024,) * 8


def test_anchor_cases_match_anchor_file():
    text = _shared("anchors/h200-2026-11-30.md")
    if text is None:
        pytest.skip("anchors file not available")
    fwd_part, bwd_part = text.split("## Backward")[0], text.split("## Backward")[1].split("## Accuracy")[0]
    rows = set(re.findall(r"^\| (\S+ \(\d+/\d+\)) \| (\S+) \|", fwd_part, re.M))
    assert rows == {(c.model, c.name) for c in bench.cases_for("anchors", bwd=False)}
    brows = set(re.findall(r"^\| (hk\d+_hv\d+) \| (\S+) \|", bwd_part, re.M))
    assert brows == {(c.model, c.name) for c in bench.cases_for("anchors", fwd=False)}


def test_flashqla_cases():
    fwd = bench.cases_for("flashqla", bwd=False)
    bwd = bench.cases_for("flashqla", fwd=False)
    assert len(fwd) == 9 * 19 == 171 and len(bwd) == 4 * 8 == 32
    for c in bwd:
        total = 8192 if c.name.startswith("8k") else 32768
        n = int(re.match(r"\d+k_(\d+)seq", c.name).group(1))
        assert sum(c.seqlens) == total and len(c.seqlens) == n and min(c.seqlens) > 0
    assert len({c.seqlens for c in bwd if c.name == "8k_4seq"}) == 1   # same split for every head config
    for c in fwd:
        assert sum(c.seqlens) == sum(int(x) for x in re.split(r"[+x]", c.name)) or "x" in c.name


def test_flashqla_cases_match_published_text():
    text = _shared("anchors/flashqla-published-h200.txt")
    if text is None:
        pytest.skip("published FlashQLA text not available")
    fwd_part, bwd_part = text.split(">>> BACKWARD")[0], text.split(">>> BACKWARD")[1]
    fwd_rows = re.findall(r"^(.+?)\s+(\d+x\d+|\d+\+\d+)\s+(\d+)\s+(\d+)\s+[\d.]+ms", fwd_part, re.M)
    bwd_rows = re.findall(r"^(hk\d+_hv\d+)\s+(\d+k_\d+seq)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+ms", bwd_part, re.M)
    fwd = bench.cases_for("flashqla", bwd=False)
    bwd = bench.cases_for("flashqla", fwd=False)
    assert len(fwd_rows) == len(fwd) and len(bwd_rows) == len(bwd)
    assert {(m.strip(), s, int(a), int(b)) for m, s, a, b in fwd_rows} == {
        (c.model.rsplit(" (", 1)[0], c.name, c.h_qk, c.h_v) for c in fwd}
    assert {(m, s, int(a), int(b), int(n)) for m, s, a, b, n in bwd_rows} == {
        (c.model, c.name, c.h_qk, c.h_v, len(c.seqlens)) for c in bwd}


def test_smoke_and_unknown_sets():
    smoke = bench.cases_for("smoke")
    assert smoke and all(c.tokens <= 512 for c in smoke)
    assert {c.direction for c in smoke} == {"fwd", "bwd", "e2e"}
    e2e = bench.cases_for("e2e")
    assert e2e and {c.direction for c in e2e} == {"e2e"} and not bench.cases_for("e2e", bwd=False)
    with pytest.raises(ValueError):
        bench.cases_for("nope")


# ----------------------------------------------------------------------------- FLOP model
def test_flop_model():
    fwd = bench.flops_per_chunk("fwd")
    assert abs(fwd - 10.5e6) / 10.5e6 < 0.02
    C, K, V = 64, 128, 128
    assert fwd == 4 * C * C * K + 4 * C * C * V + 6 * C * K * V + C ** 3 / 3
    assert abs(bench.bwd_main_flops() - 26e6) / 26e6 < 0.02
    assert abs(bench.bwd_recompute_flops() - 5e6) / 5e6 < 0.06
    assert bench.flops_per_chunk("bwd") == bench.bwd_main_flops() + bench.bwd_recompute_flops()
    assert bench.flops_per_chunk("e2e") == fwd + bench.flops_per_chunk("bwd")   # autograd: forward + backward
    # scales: doubling V roughly doubles the state products
    assert bench.flops_per_chunk("fwd", V=256) > fwd
    with pytest.raises(ValueError):
        bench.flops_per_chunk("sideways")
    # partial chunks count whole, per sequence; linear in h_v
    assert bench.case_flops("fwd", [64], 1) == fwd
    assert bench.case_flops("fwd", [65], 1) == 2 * fwd
    assert bench.case_flops("fwd", [32, 32], 1) == 2 * fwd
    assert bench.case_flops("bwd", [32768], 8) == 512 * 8 * bench.flops_per_chunk("bwd")
    assert "C^3/3" in bench.FLOP_MODEL and "4CKV + 2C^2V" in bench.FLOP_MODEL


# ----------------------------------------------------------------------------- record
def _fake_record(device="cuda", date="2026-12-01T00:00:00Z"):
    cases = [c for s in ("anchors",) for c in bench.cases_for(s)]
    entries = []
    for i, c in enumerate(cases):
        ms = {"flashqla": {"eager": 0.5 + 0.01 * i, "graph": 0.4 + 0.01 * i},
              "fla_triton": {"eager": 1.0 + 0.02 * i, "graph": 0.9}}
        errors = []
        if i % 5 == 0:
            errors.append({"lib": "flash_qla_tilelang", "stage": "setup", "error": "RuntimeError: boom"})
        else:
            ms["flash_qla_tilelang"] = {"eager": 0.45}
            errors.append({"lib": "flash_qla_tilelang", "stage": "graph", "error": "RuntimeError: capture"})
        entries.append(bench.case_entry(c, ms, errors))
    rec = {"schema": 1, "commit": "0" * 40, "dirty": False, "gpu": "NVIDIA H200" if device == "cuda" else None,
           "sm_count": 132, "driver": "580.159.03", "date": date, "device": device,
           "versions": {"torch": "2.11.0", "triton": "3.6.0", "fla": "0.6.0", "flash_qla": "0.1.3"},
           "case_set": "anchors", "libs": list(bench.LIBS), "flashqla_path": "PyTorch chunked implementation",
           "flop_model": bench.FLOP_MODEL, "cases": entries, "errors": [],
           "accuracy": {"flashqla": dict.fromkeys(bench.ACCURACY_KEYS, 1e-3), "fla_triton": {"o": 3e-3}},
           "accuracy_case": {"seqlens": [300], "h_qk": 2, "h_v": 4}}
    return bench.validate_record(rec)


def test_case_entry_tflops_speedup_errors():
    c = bench.Case("fwd", "TP1 (16/64)", 16, 64, "1x32768", (32768,))
    e = bench.case_entry(c, {"flashqla": {"eager": 2.0, "graph": 1.0}, "fla_triton": {"eager": 4.0}},
                         [{"lib": "flash_qla_tilelang", "stage": "import", "error": "not importable"}])
    flop = 512 * 64 * bench.flops_per_chunk("fwd")
    assert e["flop"] == flop and e["chunks"] == 512 and e["tokens"] == 32768
    assert math.isclose(e["tflops"]["flashqla"]["graph"], flop / 1e-3 / 1e12)
    assert e["speedup"] == {"fla_triton": {"eager": 2.0}}          # no graph time for FLA -> no graph ratio
    assert "flash_qla_tilelang" not in e["ms"] and e["errors"][0]["lib"] == "flash_qla_tilelang"


def test_clock_sampler_summary_and_entry(monkeypatch):
    # the SM clock / power sampler (flashqla._nvml): medians of its samples into the case entry; without NVML (this
    # CPU machine) nothing is sampled and the entry has no clocks
    from flashqla import _nvml
    s = _nvml.Sampler()
    assert s.summary() is None
    s.samples = [(1980.0, 650.0), (1755.0, 700.0), (1830.0, None)]
    assert s.summary() == {"sm_mhz": 1830.0, "sm_mhz_min": 1755.0, "samples": 3, "power_w": 675.0}
    monkeypatch.setattr(_nvml, "_handle", lambda index: None)  # (no NVML: the thread never starts)
    with _nvml.Sampler() as quiet:
        pass
    assert quiet.summary() is None and quiet._thread is None
    c = bench.Case("fwd", "TP1 (16/64)", 16, 64, "1x32768", (32768,))
    clocks = {"flashqla": {"graph": {"sm_mhz": 1755.0}}}
    assert bench.case_entry(c, {"flashqla": {"graph": 1.0}}, [], clocks=clocks)["clocks"] == clocks
    assert "clocks" not in bench.case_entry(c, {"flashqla": {"graph": 1.0}}, [])


def test_record_schema_and_json():
    rec = _fake_record()
    for key in ("commit", "dirty", "gpu", "case_set", "versions", "cases", "accuracy", "sm_count", "driver", "date",
                "flop_model"):
        assert key in rec
    c0 = rec["cases"][0]
    for key in ("direction", "h_qk", "h_v", "seqlens", "ms", "model", "name", "tflops", "speedup", "errors"):
        assert key in c0
    assert set(c0["ms"]["flashqla"]) == {"eager", "graph"}
    back = json.loads(json.dumps(rec, allow_nan=False))
    assert bench.validate_record(back) == rec
    bad = json.loads(json.dumps(rec))
    bad["cases"][1]["ms"]["flashqla"]["eager"] = float("nan")
    with pytest.raises(ValueError):
        bench.validate_record(bad)
    bad = json.loads(json.dumps(rec))
    del bad["commit"]
    with pytest.raises(ValueError):
        bench.validate_record(bad)


def test_record_meta_and_git_env(tmp_path, monkeypatch):
    meta = bench.record_meta("cpu")
    for key in ("commit", "dirty", "gpu", "sm_count", "driver", "date", "versions"):
        assert key in meta
    assert meta["versions"]["torch"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"])
    monkeypatch.setenv("FLASHQLA_COMMIT", "a" * 40)
    monkeypatch.setenv("FLASHQLA_DIRTY", "1")
    assert bench.git_info(tmp_path) == ("a" * 40, True)          # no .git there
    # the env wins over a .git that is there (the H200 copy's .git can be stale)
    assert bench.git_info(bench.REPO_ROOT) == ("a" * 40, True)
    monkeypatch.delenv("FLASHQLA_COMMIT")
    monkeypatch.delenv("FLASHQLA_DIRTY")
    assert bench.git_info(tmp_path) == ("unknown", None)
    monkeypatch.setenv("FLASHQLA_CP", "0")                         # switches that change what runs are recorded
    assert bench.record_meta("cpu")["env"]["FLASHQLA_CP"] == "0"


def test_default_out_names():
    rec = _fake_record()
    rec["case_set"] = "anchors,smoke"
    p = bench.default_out(rec)
    assert p.parent.name == "results" and p.name == "h200-anchors+smoke-20261201T000000Z.json"
    rec["device"], rec["gpu"] = "cpu", None
    assert bench.default_out(rec).name.startswith("cpu-fallback-")


# ----------------------------------------------------------------------------- rendering
def test_markdown_and_console_table():
    rec = _fake_record()
    md = bench.render_markdown(rec)
    assert "### Forward" in md and "### Backward" in md and "FLOP model:" in md
    assert "| TP8 (2/8) | 1x32768 |" in md and "| hk16_hv32 | 8k_4seq |" in md
    assert md.count("\n| TP") + md.count("\n| 35B") == 24
    assert "–" in md                                              # FlashQLA's missing times
    assert "errors in the record" in md and "autograd" in md
    assert "vs FLA" in md and "vs FlashQLA" in md
    rows = md.split("\n")
    assert "| 2.00x / 2.25x | – / – |" in rows[4]                 # FLA 1.0/0.9 vs 0.5/0.4; FlashQLA failed
    assert "| 0.88x / – |" in rows[5]                             # FlashQLA eager only: 0.45 / 0.51
    con = bench.render_console(rec)
    assert len(con.splitlines()) >= 29 and "geomean fwd FLA/flashqla" in con
    cpu = _fake_record(device="cpu")
    assert "CPU fallback timings" in bench.render_markdown(cpu)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rec = _fake_record()
    p = bench.make_plot(rec, tmp_path / "sub" / "plot.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    fwd_only = dict(rec, cases=[c for c in rec["cases"] if c["direction"] == "fwd"])
    assert bench.make_plot(fwd_only, tmp_path / "fwd.png").is_file()


def test_readme_update(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    old = _fake_record(date="2026-12-01T00:00:00Z")
    new = _fake_record(date="2026-12-02T00:00:00Z")
    new["commit"] = "b" * 40
    cpu = _fake_record(device="cpu", date="2026-12-09T00:00:00Z")
    for name, r in (("h200-a-old.json", old), ("h200-a-new.json", new), ("cpu-fallback-smoke-x.json", cpu)):
        (results / name).write_text(json.dumps(r))
    (results / "junk.json").write_text("{not json")
    assert bench.newest_record(results).name == "h200-a-new.json"   # CPU records are never picked
    cut = _fake_record(date="2026-12-05T00:00:00Z")
    cut["partial"] = True
    (results / "h200-a-cut.json").write_text(json.dumps(cut))
    assert bench.newest_record(results).name == "h200-a-new.json"   # a complete record beats a newer partial one
    assert "Partial record" in bench.render_markdown(cut) and "Partial record" not in bench.render_markdown(new)
    (results / "h200-a-cut.json").unlink()
    sub = _fake_record(date="2026-12-06T00:00:00Z")
    sub["match"] = "TP8"
    (results / "h200-a-sub.json").write_text(json.dumps(sub))
    assert bench.newest_record(results).name == "h200-a-new.json"   # ... and so does a full set over a --match run
    (results / "h200-a-sub.json").unlink()
    ab = _fake_record(date="2026-12-07T00:00:00Z")
    ab["libs"] = ["flashqla"]
    (results / "h200-a-ab.json").write_text(json.dumps(ab))
    one_dir = _fake_record(date="2026-12-08T00:00:00Z")
    one_dir["cases"] = [c for c in one_dir["cases"] if c["direction"] == "fwd"]
    (results / "h200-a-fwd.json").write_text(json.dumps(one_dir))
    assert bench.newest_record(results).name == "h200-a-new.json"   # ... and over A/B and one-direction runs
    (results / "h200-a-ab.json").unlink()
    (results / "h200-a-fwd.json").unlink()
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nintro\n\n{bench.README_START}\nstale text\n{bench.README_END}\n\ntail\n")
    bench.update_readme(readme, results / "h200-a-new.json")
    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n\n" + bench.README_START) and text.endswith(bench.README_END + "\n\ntail\n")
    assert "stale text" not in text and "bbbbbbbbbbbb" in text and "| TP1 (16/64) | 1x32768 |" in text
    bench.update_readme(readme, results / "h200-a-new.json")
    assert readme.read_text() == text                               # idempotent
    assert bench.main(["readme", "--record", str(results / "h200-a-old.json"), "--readme", str(readme)]) == 0
    assert "0000000000" in readme.read_text()
    nomark = tmp_path / "R2.md"
    nomark.write_text("no markers\n")
    with pytest.raises(ValueError):
        bench.update_readme(nomark, results / "h200-a-new.json")
    with pytest.raises(FileNotFoundError):
        bench.newest_record(tmp_path / "empty")


# ----------------------------------------------------------------------------- end to end on CPU
def test_cpu_smoke_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "outdir"))
    (tmp_path / "outdir").mkdir()
    out = tmp_path / "rec.json"
    assert bench.main(["run", "--device", "cpu", "--cases", "anchors", "--cpu-reps", "2", "--out", str(out)]) == 0
    rec = bench.validate_record(json.loads(out.read_text()))
    assert rec["device"] == "cpu" and rec["case_set"] == "smoke"          # GPU sets are replaced on CPU
    assert len(rec["cases"]) == len(bench.cases_for("smoke"))
    for c in rec["cases"]:
        assert set(c["ms"]) == {"flashqla"} and set(c["ms"]["flashqla"]) == {"eager"}
        assert {e["lib"] for e in c["errors"]} == {"fla_triton", "flash_qla_tilelang"}
    acc = rec["accuracy"]["flashqla"]
    assert set(acc) == set(bench.ACCURACY_KEYS) and max(acc.values()) < 2e-2
    assert out.with_suffix(".md").is_file()
    assert (tmp_path / "outdir" / "rec.json").is_file()
    printed = capsys.readouterr().out
    assert "Hopper" in printed and "CPU fallback" in printed


def test_merge_records(tmp_path):
    a = _fake_record()
    b = _fake_record(date="2026-12-01T01:00:00Z")
    a["cases"] = [c for c in a["cases"] if c["direction"] == "fwd"]
    b["cases"] = [c for c in b["cases"] if c["direction"] == "bwd"]
    b["accuracy"], b["case_set"] = {}, "anchors,smoke"
    m = bench.merge_records([a, b])
    assert len(m["cases"]) == 28 and m["case_set"] == "anchors,smoke" and m["accuracy"] == a["accuracy"]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "m.json"
    assert bench.main(["merge", str(pa), str(pb), "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["cases"]) == 28 and out.with_suffix(".md").is_file()
    b["gpu"] = "NVIDIA H100"
    with pytest.raises(ValueError):
        bench.merge_records([a, b])


def test_backward_label_follows_the_record(monkeypatch):
    rec = _fake_record()
    rec["labels"] = {"flashqla": {"bwd": bench.flashqla_bwd_label(kernels=True)}}
    md = bench.render_markdown(rec)
    assert "flashqla = chunk_gdn_bwd" in md and "autograd" not in md and "sm_90a kernels" in md
    # the label says what ran: no kernels, or FLASHQLA_BWD_KERNEL=0, is the PyTorch backward
    assert "PyTorch chunked backward" in bench.flashqla_bwd_label(kernels=False)
    monkeypatch.setenv("FLASHQLA_BWD_KERNEL", "0")
    assert "PyTorch chunked backward" in bench.flashqla_bwd_label(kernels=True)


def test_no_decay_heads_only_in_flashqlas_set():
    import torch
    assert not any(c.no_decay_heads for c in bench.cases_for("anchors"))   # as shared/tools/anchor_bench.py
    assert all(c.no_decay_heads for c in bench.cases_for("flashqla"))      # as FlashQLA's published benchmark
    base = bench.Case("fwd", "t (2/8)", 2, 8, "1x128", (128,))
    g = bench.make_inputs(base, "cpu")["g"]
    assert bool((g != 0).all())                                           # every head decays
    import dataclasses
    g = bench.make_inputs(dataclasses.replace(base, no_decay_heads=True), "cpu")["g"]
    zero_heads = [h for h in range(8) if bool((g[0, :, h] == 0).all())]
    assert len(zero_heads) == 8 - 6                                       # a quarter, rounded down
    assert torch.isfinite(g).all()


def test_compare_anchors_flags_outliers():
    rec = {"date": "d", "commit": "c" * 40, "cases": [
        {"direction": "fwd", "model": "TP8 (2/8)", "name": "1x32768",
         "ms": {"fla_triton": {"eager": 1.0, "graph": 0.9}, "flash_qla_tilelang": {"graph": 0.45}}},
        {"direction": "bwd", "model": "hk4_hv8", "name": "8k_4seq", "ms": {"fla_triton": {"eager": 2.0}}},
        {"direction": "fwd", "model": "TP1 (16/64)", "name": "1x99", "ms": {}}]}       # not in the anchors
    anchors = {"forward_ms": [{"model": "TP8", "seqs": "1x32768", "fla_eager": 1.0, "fla_graph": 1.0,
                               "flashqla_eager": 0.3, "flashqla_graph": 0.3}],
               "backward_ms": [{"model": "hk4_hv8", "seqs": "8k_4seq", "fla_eager": 1.9}]}
    md = bench.compare_anchors(rec, anchors)
    assert "| fwd | TP8 (2/8) | 1x32768 | 1.00 | 0.90 | – | 1.50 * |" in md
    assert "| bwd | hk4_hv8 | 8k_4seq | 1.05 | – | – | – |" in md
    assert "3 of 4 figures within +-15%" in md and "FlashQLA graph" in md and "1x99" not in md


def test_prewarm_groups_cover_every_case_once_per_library():
    cases = bench.cases_for("anchors")
    jobs = bench.prewarm_groups(cases, ["fla_triton", "flash_qla_tilelang"], accuracy_case=True)
    for lib in ("fla_triton", "flash_qla_tilelang"):
        mine = [(cs, acc) for lb, cs, acc in jobs if lb == lib]
        assert sum(acc for _, acc in mine) == 1                     # one job runs the accuracy shapes
        got = sorted((c["direction"], c["h_qk"], c["h_v"], c["name"]) for cs, _ in mine for c in cs)
        assert got == sorted((c.direction, c.h_qk, c.h_v, c.name) for c in cases)
        for cs, _ in mine:                                          # a job never mixes head configurations
            assert len({(c["h_qk"], c["h_v"], c["direction"]) for c in cs}) <= 1
    # the spec a worker receives rebuilds the same Case
    lib, cs, _ = jobs[0]
    c = cs[0]
    assert bench.Case(**{**c, "seqlens": tuple(c["seqlens"])}) in cases


def test_e2e_l2norm_switch(monkeypatch):
    # FLASHQLA_BENCH_L2NORM=1: the e2e cases call the autograd API with use_qk_l2norm_in_kernel=True (flashqla here,
    # on the CPU fallback), and the record's env says so; unset, they do not
    import torch
    case = next(c for c in bench.cases_for("smoke") if c.direction == "e2e")
    d = bench.make_inputs(case, "cpu")
    impl = dict(bench.load_libs(["flashqla"], "cpu")["flashqla"])
    seen, api = [], impl["api"]
    impl["api"] = lambda *a, **kw: seen.append(kw.get("use_qk_l2norm_in_kernel")) or api(*a, **kw)
    bench.build_fn("flashqla", impl, case, d)()
    monkeypatch.setenv("FLASHQLA_BENCH_L2NORM", "1")
    grads = bench.build_fn("flashqla", impl, case, d)()
    assert seen == [False, True] and all(torch.isfinite(t).all() for t in grads)
    assert bench.record_meta("cpu")["env"].get("FLASHQLA_BENCH_L2NORM") == "1"
    # the accuracy stage's float64 reference normalises q, k too: flashqla's CPU path agrees on every output to
    # the bf16 rounding of its results (~1.7e-3; a reference without the l2norm put dq, dk at ~1e-1 for all three
    # libraries on the H200)
    res, errs = bench.accuracy({"flashqla": impl}, "cpu")
    assert not errs and max(res["flashqla"].values()) < 5e-3, res
