"""Shards of a prepared dataset on shared storage, their reports, and the merge into one dataset.

Contract: shard ``I`` of ``N`` of the output ``BASE`` is the indexed dataset
``BASE.shard-IIIII-of-NNNNN.{bin,idx}`` (:func:`shard_prefix`), with the kept documents' digests
(``.digests``, when duplicates are removed) and its report (``.report.json``). The report is written
last, atomically: it is the shard's completion marker, and it records the settings the shard was
made with (inputs, tokenizer identity, gates, JSON key), so :func:`finished_report` can tell a
requeued task that its shard is already done. :func:`check_shard_count` refuses a shard count other
than the one already present under ``BASE``. :func:`merge_shards` (``pretrain merge-data``) checks
that all ``N`` reports are there and agree, then concatenates the shards in order with megatron-core's
``IndexedDatasetBuilder.add_index``; a shard holding documents an earlier shard already kept (only
with duplicate removal) is copied document by document without them. The result, and its merged
report, equal a one-machine run over the same inputs. Preparation itself is
:mod:`pretrain.data.prepare`; this module never tokenizes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from pretrain.data.gates import DIGEST_BYTES, DigestSet
from pretrain.errors import DataError
from tiering.system.fsio import atomic_write_bytes

_SHARD_RE = re.compile(r"\.shard-(\d{5})-of-(\d{5})\.report\.json$")


def shard_prefix(base: Path | str, index: int, count: int) -> Path:
    return Path(f"{base}.shard-{index:05d}-of-{count:05d}")


def report_path(prefix: Path | str) -> Path:
    return Path(f"{prefix}.report.json")


def digests_path(prefix: Path | str) -> Path:
    return Path(f"{prefix}.digests")


def write_report(prefix: Path | str, report: Mapping[str, Any]) -> None:
    atomic_write_bytes(report_path(prefix), (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())


def read_report(prefix: Path | str) -> dict[str, Any] | None:
    """The shard's report, or None when there is none yet (a partial write is never visible)."""
    try:
        return json.loads(report_path(prefix).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def _present_shards(base: Path | str) -> dict[tuple[int, int], Path]:
    """(index, count) -> prefix of every shard report under ``base``."""
    base = Path(base)
    found = {}
    for path in base.parent.glob(f"{glob_escape(base.name)}.shard-*-of-*.report.json"):
        m = _SHARD_RE.search(path.name)
        if m and path.name[: m.start()] == base.name:
            found[(int(m.group(1)), int(m.group(2)))] = Path(str(path)[: -len(".report.json")])
    return found


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def check_shard_count(base: Path | str, count: int) -> None:
    """DataError (one line) if ``base`` already holds shards of another split."""
    for (index, other), prefix in sorted(_present_shards(base).items()):
        if other != count:
            raise DataError(
                f"{base}: shard {index}/{other} of a {other}-way split is already there ({report_path(prefix).name}), "
                f"this run splits {count} ways; fix: use the same N for every shard (--shard I/{other}), or "
                "remove the old shards or choose another --output"
            )


def finished_report(
    prefix: Path | str, settings: Mapping[str, Any], snapshot_of: Callable[[Path], str]
) -> dict[str, Any] | None:
    """The report of a shard already made with ``settings`` whose files are intact, else None."""
    report = read_report(prefix)
    if report is None or report.get("settings") != dict(settings):
        return None
    if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
        return None
    return report if snapshot_of(Path(prefix)) == report.get("snapshot") else None


def _describe_tokenizer(ident: Mapping[str, Any]) -> str:
    if ident.get("kind") == "byte":
        return "byte"
    return f"{ident.get('kind')} {ident.get('file')} (sha256:{str(ident.get('sha256')).removeprefix('sha256:')[:12]})"


def _check_agreement(base: Path | str, reports: dict[int, dict[str, Any]], count: int) -> None:
    first = reports[0]["settings"]
    for index, report in sorted(reports.items()):
        mine = report["settings"]
        if mine["tokenizer"] != first["tokenizer"]:
            raise DataError(
                f"{base}: shard 0/{count} was made with tokenizer {_describe_tokenizer(first['tokenizer'])} "
                f"but shard {index}/{count} with {_describe_tokenizer(mine['tokenizer'])}; fix: re-run shard "
                f"{index} (or 0) with the same --tokenizer/--tokenizer-path"
            )
        for key in sorted(set(mine) | set(first)):
            if key != "shard" and mine.get(key) != first.get(key):
                raise DataError(
                    f"{base}: shard {index}/{count} differs from shard 0/{count} in {key} "
                    f"({mine.get(key)!r} vs {first.get(key)!r}); fix: re-run that shard with the same inputs and "
                    "options as the others"
                )


def collect_shards(base: Path | str) -> tuple[int, dict[int, Path], dict[int, dict[str, Any]]]:
    """The complete, agreeing shard set under ``base``: (count, prefixes, reports); DataError otherwise."""
    present = _present_shards(base)
    if not present:
        raise DataError(
            f"{base}: no shard reports ({Path(str(base)).name}.shard-*-of-*.report.json); fix: run "
            f"'pretrain prepare-data --shard I/N --output {base} ...' for every I first"
        )
    counts = sorted({n for _, n in present})
    if len(counts) > 1:
        raise DataError(
            f"{base}: shards of {' and '.join(map(str, counts))}-way splits are mixed; fix: remove the shards of the "
            "split you do not want, or re-run every shard with one --shard I/N"
        )
    count = counts[0]
    prefixes = {i: p for (i, _), p in present.items()}
    missing = [i for i in range(count) if i not in prefixes]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise DataError(
            f"{base}: shard(s) {shown} of {count} not finished; fix: run 'pretrain prepare-data --shard I/{count}' "
            "for them (or wait for the array job) and merge again"
        )
    reports = {i: read_report(p) or {} for i, p in prefixes.items()}
    _check_agreement(base, reports, count)
    return count, prefixes, reports


def _new_documents(prefix: Path, documents: int, seen: DigestSet) -> bytearray:
    """Per document of the shard, 1 if no earlier document had its digest (it is added to ``seen``),
    0 if one did; the shard's digests are read in pieces (memory bounded by the shard's count)."""
    path = digests_path(prefix)
    size = path.stat().st_size
    if size != documents * DIGEST_BYTES:
        raise DataError(
            f"{path}: {size // DIGEST_BYTES} digests for {documents} documents; fix: re-run "
            "that shard (its files are inconsistent)"
        )
    keep = bytearray()
    with open(path, "rb") as f:
        while piece := f.read(DIGEST_BYTES * 65536):
            keep += bytes(seen.add(piece[i : i + DIGEST_BYTES]) for i in range(0, len(piece), DIGEST_BYTES))
    return keep


def _append_without(builder: IndexedDatasetBuilder, prefix: Path, keep: bytearray) -> int:
    """Copy the documents of ``prefix`` whose ``keep`` is true; return the tokens left out."""
    dataset = IndexedDataset(str(prefix))
    dropped_tokens = 0
    for j, kept in enumerate(keep):
        ids = dataset[j]
        if kept:
            builder.add_document(ids, [len(ids)])
        else:
            dropped_tokens += len(ids)
    return dropped_tokens


def merge_shards(base: Path | str, output: Path | str) -> dict[str, Any]:
    """``pretrain merge-data``: all shards of ``base`` -> ``output.{bin,idx}`` and its report."""
    count, prefixes, reports = collect_shards(base)
    dedup = bool(reports[0]["settings"]["gates"]["dedup"])
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = {s: Path(f"{out}{s}.tmp-{os.getpid()}") for s in (".bin", ".idx")}
    if sum(r["documents"] for r in reports.values()) == 0:
        raise DataError(
            f"{base}: every shard is empty (no documents passed the gates); fix: check --input and the gates"
        )
    # the dtype prepare-data wrote (Megatron's choice for the vocabulary); an empty shard has no .bin to ask
    dtype = DType.optimal_dtype(reports[0]["settings"]["tokenizer"]["vocab_size"])
    builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=dtype)
    seen = DigestSet(out.parent) if dedup else None  # on disk: the merge sees every shard's digests
    across = {"documents": 0, "tokens": 0}
    try:
        for i in range(count):
            keep = _new_documents(prefixes[i], reports[i]["documents"], seen) if seen is not None else None
            if reports[i]["documents"] == 0:
                continue  # an empty .bin cannot be mapped, and adds nothing
            if keep is None or all(keep):
                builder.add_index(str(prefixes[i]))
            else:
                across["tokens"] += _append_without(builder, prefixes[i], keep)
                across["documents"] += keep.count(0)
        builder.finalize(str(tmp[".idx"]))
        for suffix, path in tmp.items():
            os.replace(path, f"{out}{suffix}")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        if seen is not None:
            seen.close()
    return merged_report([reports[i] for i in range(count)], across)


def merged_report(reports: list[dict[str, Any]], across: Mapping[str, int]) -> dict[str, Any]:
    """One report for the merged dataset: the shards' counts summed, less the cross-shard duplicates."""
    dropped: dict[str, int] = {}
    for r in reports:
        for reason, n in r["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    dropped["duplicate"] = dropped.get("duplicate", 0) + across["documents"]
    settings = {k: v for k, v in reports[0]["settings"].items() if k != "shard"}
    return {
        "settings": {**settings, "shard": None},
        "documents": sum(r["documents"] for r in reports) - across["documents"],
        "tokens": sum(r["tokens"] for r in reports) - across["tokens"],
        "text_bytes": sum(r["text_bytes"] for r in reports),
        "dropped": dropped,
        "bad_files": [f for r in reports for f in r["bad_files"]],
        "shards": len(reports),
    }
