"""Adapters that are not on local disk yet: fetched once, on first use, from a configured URI prefix into the local
cache (loom.lora.adapter_cache), and from there loaded like any local adapter.

How a request names one (the flow of local adapters, extended by one step, with no new request field):
* `lora_name` alone: looked up under `adapter_roots` first, as always; if no folder of that name is there, under
  each of `adapter_sources` in order, as `<source>/<name>/` (the first that holds an adapter_config.json wins).
* `load` / `reload` with a `lora_path` that is a URI (it holds `://`): the URI must lie under one of
  `adapter_sources` (the same protocol, the source's path followed by `/`, no `..`), else RequestError("lora_path").
  A `lora_path` without `://` is a local path and keeps the adapter_roots rule (loom.lora.adapter_paths).
Nothing else is fetched: a URI outside the sources is refused before any I/O, and a `file://` source follows the
local rule as well (its adapter's folder and files, symlinks resolved, must stay inside the source's folder).

The URI checks do no I/O (the loop thread may make them); `find` and `fetch` do (the registry's loader thread
calls them). Filesystems are fsspec's: `file://`, `memory://`, and whatever fsspec implementations are installed
(`s3://` needs s3fs, `gs://` gcsfs, ...); credentials come from their usual environment.
"""
from __future__ import annotations

import posixpath
import shutil
from typing import Sequence

from loom.errors import ConfigError, RequestError
from loom.kernels.cpu_ext import cache_dir as kernel_cache_dir
from loom.lora.adapter_cache import ADAPTER_FILES, AdapterCache
from loom.lora.adapter_paths import resolve_adapter_path
from loom.lora.peft_config import CONFIG_NAME, AdapterLoadError


def is_uri(path: str) -> bool:
    return isinstance(path, str) and "://" in path


def default_cache_dir() -> str:
    """`adapters/` beside the CPU kernels' folder: $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom or ~/.cache/loom."""
    return str(kernel_cache_dir().parent / "adapters")


class AdapterSources:
    """The configured URI prefixes and the cache their adapters are fetched into."""

    def __init__(self, sources: Sequence[str], cache_dir: str, cache_bytes: int):
        import fsspec  # only where sources are configured

        self.sources: list[tuple[tuple[str, ...], str, object]] = []  # (protocols, path without protocol, filesystem)
        for uri in sources:
            try:
                fs, path = fsspec.core.url_to_fs(uri)
            except (ImportError, ValueError) as e:
                raise ConfigError("adapter_sources", f"{uri!r}: {e}") from None
            protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
            self.sources.append((protocols, path.rstrip("/"), fs))
        self.cache = AdapterCache(cache_dir or default_cache_dir(), cache_bytes)

    def check(self, uri: str, field_name: str = "lora_path") -> str:
        """The canonical spelling of `uri` if it lies under a configured source, else RequestError(field_name).
        No I/O."""
        return self._locate(uri, field_name)[0]

    def find(self, name: str) -> str:
        """The URI `<source>/<name>` of the first source holding that adapter (I/O), else AdapterLoadError."""
        for protocols, root, fs in self.sources:
            try:
                if fs.isfile(f"{root}/{name}/{CONFIG_NAME}"):
                    return f"{protocols[0]}://{root}/{name}"
            except Exception:  # noqa: BLE001 - an unreachable source is one without the adapter; try the next
                continue
        raise AdapterLoadError(f"unknown adapter {name!r}: not loaded, and no folder of that name under the "
                               f"adapter_roots or the adapter_sources")

    def fetch(self, uri: str, refresh: bool = False) -> str:
        """The local cache folder of the adapter at `uri`, transferred first unless cached (or when `refresh`)."""
        uri, (protocols, root, fs), path = self._locate(uri, "lora_path")
        if "file" in protocols:  # the adapter_roots rule: symlinks may not leave the source's folder
            path = resolve_adapter_path(path, [root], "lora_path")

        def sizes() -> dict[str, int]:
            try:
                return {f: int(fs.size(posixpath.join(path, f))) for f in ADAPTER_FILES}
            except FileNotFoundError as e:
                raise AdapterLoadError(f"{uri}: {e}") from None

        try:
            return self.cache.get(uri, sizes, lambda fname, dest: _transfer(fs, posixpath.join(path, fname), dest),
                                  refresh)
        except AdapterLoadError:
            raise
        except Exception as e:  # noqa: BLE001 - a transfer error of any filesystem
            raise AdapterLoadError(f"fetching {uri}: {e!r}") from None

    def _locate(self, uri: str, field_name: str) -> tuple[str, tuple, str]:
        """(canonical URI, its source, path on its filesystem) of a URI under a source, else
        RequestError(field_name)."""
        if not self.sources:
            raise RequestError(field_name, f"{uri!r} is a URI, and no adapter_sources are configured")
        if "::" in uri or "\0" in uri or ".." in uri.split("://", 1)[1].split("/"):
            raise RequestError(field_name, f"adapter URI {uri!r} may not contain '..' or '::'")
        protocol = uri.split("://", 1)[0]
        for src in self.sources:
            protocols, root, fs = src
            if protocol in protocols:
                path = fs._strip_protocol(uri).rstrip("/")  # as fsspec spells paths on this filesystem
                if path.startswith(root + "/"):
                    return f"{protocols[0]}://{path}", src, path
        raise RequestError(field_name, f"adapter URI {uri!r} is outside the configured adapter_sources")


def _transfer(fs, remote_path: str, dest: str) -> None:
    with fs.open(remote_path, "rb") as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
