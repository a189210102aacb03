"""The kernel/wrapper cache: keyed by source hash, private directory, corrupt entries rebuilt."""
import os
import stat

import pytest
import torch

from fxopt.codegen.cache import ModuleCache, source_hash

SRC = "VALUE = 41 + 1\n"


def test_second_load_hits_and_modules_are_fresh(tmp_path):
    cache = ModuleCache(str(tmp_path / "c"))
    a = cache.load(SRC)
    b = cache.load(SRC)
    assert (cache.misses, cache.hits) == (1, 1)
    assert a.VALUE == b.VALUE == 42 and a is not b  # globals set on one never leak into the other
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700


def test_corrupt_entry_is_ignored_and_rewritten(tmp_path):
    cache = ModuleCache(str(tmp_path / "c"))
    path = cache.path_for(SRC)
    with open(path, "w") as f:
        f.write("VALUE = 'tampered'\n")
    assert cache.load(SRC).VALUE == 42
    with open(path) as f:
        assert f.read() == SRC
    assert os.path.basename(path) == f"fx_{source_hash(SRC)[:40]}.py"


def test_world_writable_cache_dir_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(PermissionError, match="not private"):
        ModuleCache(str(root)).load(SRC)


def test_second_compile_of_the_same_graph_hits_the_cache():
    import fxopt

    def f(x):
        return torch.relu(x) * 3 - 1

    first = fxopt.explain(f, torch.randn(5, 7))
    second = fxopt.explain(f, torch.randn(5, 7))
    assert first.graphs[0].cache["misses"] in (0, 1)
    assert second.graphs[0].cache == {"hits": 1, "misses": 0}
