"""The kernel-source digest that builds carry and benchmark records store (flashqla/_fingerprint.py)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashqla import _fingerprint as fp

REPO = Path(__file__).resolve().parents[1]


def test_the_digest_follows_the_sources_and_nothing_else(tmp_path):
    src = tmp_path / "csrc" / "flashqla"
    src.mkdir(parents=True)
    (src / "a.cu").write_text("__global__ void k() {}\n")
    (src / "b.cuh").write_text("#pragma once\n")
    first = fp.tree_fingerprint(tmp_path)
    assert len(first) == 16 and int(first, 16) >= 0
    (tmp_path / "csrc" / "notes.md").write_text("not a source")  # other files do not count
    (tmp_path / "README.md").write_text("outside csrc")
    assert fp.tree_fingerprint(tmp_path) == first
    (src / "a.cu").write_text("__global__ void k() { }\n")  # one byte of a source does
    assert fp.tree_fingerprint(tmp_path) != first
    (src / "a.cu").write_text("__global__ void k() {}\n")
    (src / "b.cuh").rename(src / "c.cuh")  # and so does a file's name
    assert fp.tree_fingerprint(tmp_path) != first


def test_the_mark_is_found_in_a_binary():
    text = fp.source_file("0123456789abcdef")
    blob = b"\x7fELF\0\0garbage" + text.encode() + b"\0more"
    assert fp.binary_fingerprint(blob) == "0123456789abcdef"
    assert fp.binary_fingerprint(b"no mark here " + fp.MARK.encode() + b"xyz") is None


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_the_working_tree_and_its_commit_agree():
    status = subprocess.run(["git", "status", "--porcelain", "--", fp.SOURCE_DIR], cwd=REPO, capture_output=True,
                            text=True)
    if status.returncode != 0 or status.stdout.strip():
        pytest.skip("csrc/ has changes against HEAD")
    assert fp.commit_fingerprint("HEAD", REPO) == fp.tree_fingerprint(REPO)
    assert fp.commit_fingerprint("no-such-revision", REPO) is None


def test_the_built_extension_is_built_from_these_sources():
    # (a stale build would run, and test, other kernels than the tree's)
    import flashqla  # noqa: F401
    ext = sys.modules.get("flashqla._C")
    if ext is None or fp.extension_fingerprint(ext.__file__) is None:
        pytest.skip("no extension built with the digest")
    assert fp.extension_fingerprint(ext.__file__) == fp.tree_fingerprint(REPO)
