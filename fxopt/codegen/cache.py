"""On-disk cache of generated modules, keyed by the SHA-256 of their source.

The directory is per user and created with mode 0700: cached files are executed, so a shared
world-writable path would let another user run code as you. Writes go to a temporary file and are
renamed into place, so two processes compiling the same module at once both end with a whole file.
An entry whose content does not hash to its name is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from types import ModuleType


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


@dataclass
class ModuleCache:
    root: str
    hits: int = 0
    misses: int = 0
    _loads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _dir(self) -> str:
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as e:
            raise OSError(f"fxopt: cannot use {self.root!r} as the kernel cache ({e.strerror}); set FXOPT_CACHE_DIR "
                          "to a directory this user can create and write") from e
        st = os.stat(self.root)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
            raise PermissionError(
                f"fxopt: cache directory {self.root} is not private to this user (owner uid {st.st_uid}, "
                f"mode {oct(stat.S_IMODE(st.st_mode))}); set FXOPT_CACHE_DIR to a directory only you can write")
        return self.root

    def path_for(self, source: str) -> str:
        """Write `source` under its hash (unless a valid entry exists) and return the file's path."""
        digest = source_hash(source)
        path = os.path.join(self._dir(), f"fx_{digest[:40]}.py")
        try:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() == digest:
                    self.hits += 1
                    return path
        except FileNotFoundError:
            pass
        self.misses += 1
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp_", suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
        return path

    def load(self, source: str) -> ModuleType:
        """Import `source` as a fresh module from its cache file (triton.jit needs a real file to read).

        Fresh every time: callers set module globals (constants), which must not leak between two
        compiled graphs that happen to share source."""
        path = self.path_for(source)
        with self._lock:
            self._loads += 1
            name = f"fxopt_generated_{os.path.basename(path)[3:19]}_{self._loads}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # triton.jit looks the function's module up here
        spec.loader.exec_module(module)
        return module


_CACHES: dict[str, ModuleCache] = {}


def module_cache(root: str) -> ModuleCache:
    """One cache object per directory per process (it also remembers loaded modules)."""
    if root not in _CACHES:
        _CACHES[root] = ModuleCache(root)
    return _CACHES[root]
