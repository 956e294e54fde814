"""``cortiq inspect`` (what a CMF file holds) and ``cortiq verify`` (its checksums)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from cortiq_cli.common import BytesColumn, console, err_console, fail, handle_errors, human_bytes, print_json
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.untrusted_json import section
from formats.sidecar import ROLE_SIDECAR, check_sidecar, sidecar_path


# ------------------------------------------------------------------ inspect


def _dtype_summary(f: CmfFile) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for t in f.tensors.values():
        s = out.setdefault(t.dtype, {"tensors": 0, "params": 0, "bytes": 0})
        s["tensors"] += 1
        n = 1
        for d in t.shape:
            n *= d
        s["params"] += n
        s["bytes"] += t.nbytes
    return out


def _partner(f: CmfFile) -> tuple[Path | None, str | None, dict[str, Any]]:
    """The file this one pairs with (its sidecar, or for a sidecar its backbone), the
    reason they do not match (None if they match), and a summary of its tensors."""
    if f.header.get("role") == ROLE_SIDECAR:
        name = section(f.header, "backbone").get("file")
        # a plain file name beside the sidecar; anything else ("../x", "a/b", "") is ignored
        plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
        other = f.path.with_name(name) if plain else None
        if other is None or not other.is_file() or other == f.path:
            return None, None, {}
    else:
        other = sidecar_path(f.path)
        if not other.is_file() or other == f.path:
            return None, None, {}
    summary: dict[str, Any] = {}
    try:
        with CmfFile(other) as o:
            summary = {
                "tensors": len(o.tensors),
                "bytes": sum(t.nbytes for t in o.tensors.values()),
                "dtypes": _dtype_summary(o),
            }
            main, side = (o.header, f.header) if f.header.get("role") == ROLE_SIDECAR else (f.header, o.header)
            check_sidecar(main, side)
    except CortiqError as e:
        return other, str(e), summary
    return other, None, summary


def describe(f: CmfFile, with_tensors: bool) -> dict[str, Any]:
    partner, problem, summary = _partner(f)
    d: dict[str, Any] = {
        "path": str(f.path),
        "size": f.size,
        "format_version": f"{f.version}.{f.minor_version}",
        "header": f.header,
        "dtypes": _dtype_summary(f),
        "tensor_count": len(f.tensors),
        "partner": None
        if partner is None
        else {
            "path": str(partner),
            "kind": "backbone" if f.header.get("role") == ROLE_SIDECAR else "sidecar",
            "valid": problem is None,
            "error": problem,
            **summary,
        },
    }
    if with_tensors:
        d["tensors"] = [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "offset": t.offset,
                "bytes": t.nbytes,
                "crc32": f"{t.crc32:08x}",
            }
            for t in sorted(f.tensors.values(), key=lambda t: t.offset)
        ]
    return d


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items() if x not in (None, [], {}, False)) or "-"
    if isinstance(v, list):
        if v and all(isinstance(x, str) for x in v):
            counts: dict[str, int] = {}
            for x in v:
                counts[x] = counts.get(x, 0) + 1
            return ", ".join(f"{k}×{n}" for k, n in counts.items())
        return ", ".join(_fmt(x) for x in v)
    return "-" if v is None else str(v)


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, _fmt(v))
    return t


def _render(d: dict[str, Any]) -> None:
    h = d["header"]
    arch = h.get("arch") if isinstance(h.get("arch"), dict) else {}
    console.print(
        f"[bold]{d['path']}[/]  {human_bytes(d['size'])}  CMF {d['format_version']}  role={h.get('role', '-')}",
        highlight=False,
    )
    console.print(_kv_table("architecture", [(k, v) for k, v in arch.items() if v not in (None, [], {})]))
    tok = h.get("tokenizer")
    if isinstance(tok, dict):
        chat = tok.get("chat_template")
        console.print(
            _kv_table(
                "tokenizer",
                [
                    ("model", tok.get("model")),
                    ("vocab size", tok.get("vocab_size")),
                    ("bos", f"{tok.get('bos_token_id')} {tok.get('bos_token') or ''}".strip()),
                    ("eos", f"{_fmt(tok.get('eos_token_ids'))} {tok.get('eos_token') or ''}".strip()),
                    ("add bos", tok.get("add_bos_token")),
                    ("chat template", f"yes ({len(chat)} chars)" if isinstance(chat, str) and chat else "no"),
                ],
            )
        )
    if isinstance(h.get("calibration"), dict):
        cal = h["calibration"]
        temp = cal.get("temperature")
        extra = {k: v for k, v in cal.items() if k != "temperature"}
        shown = f"{temp:.4f}" if isinstance(temp, (int, float)) and not isinstance(temp, bool) else _fmt(temp)
        console.print(
            _kv_table(
                "calibration",
                [("temperature", "not calibrated" if temp is None else shown)] + [(k, v) for k, v in extra.items()],
            )
        )
    if isinstance(h.get("mtp"), dict):
        console.print(_kv_table("MTP", list(h["mtp"].items())))
    if isinstance(h.get("backbone"), dict):
        console.print(_kv_table("backbone", list(h["backbone"].items())))
    if isinstance(h.get("source"), dict):
        console.print(_kv_table("source", list(h["source"].items())))
    console.print(_kv_table("converter", [("converter", h.get("converter")), ("quant", h.get("quant"))]))

    t = Table(title="tensors", title_justify="left")
    for col in ("dtype", "tensors", "params", "bytes"):
        t.add_column(col, justify="left" if col == "dtype" else "right")
    for name, s in sorted(d["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
        t.add_row(name, str(s["tensors"]), f"{s['params']:,}", human_bytes(s["bytes"]))
    console.print(t)
    if "tensors" in d:
        t = Table(title="tensor directory", title_justify="left")
        for col in ("name", "dtype", "shape", "bytes", "crc32"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for e in d["tensors"]:
            t.add_row(e["name"], e["dtype"], "×".join(map(str, e["shape"])) or "scalar", f"{e['bytes']:,}", e["crc32"])
        console.print(t)
    p = d["partner"]
    if p is not None:
        status = "[green]matches[/]" if p["valid"] else f"[red]does not match[/]: {p['error']}"
        size = f" ({p['tensors']} tensors, {human_bytes(p['bytes'])})" if "tensors" in p else ""
        console.print(f"{p['kind']}: {p['path']}{size} {status}", highlight=False)


@handle_errors
def inspect(
    file: Path = typer.Argument(..., help="A .cmf file."),
    tensors: bool = typer.Option(False, "--tensors", help="List every tensor."),
    json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show a CMF file's header, tensors, and the MTP sidecar beside it."""
    with CmfFile(file) as f:
        d = describe(f, tensors)
    if json_out:
        print_json(d)
    else:
        _render(d)
    p = d["partner"]
    if p is not None and not p["valid"]:
        fail(f"{p['path']}: {p['error']}")


# ------------------------------------------------------------------ verify


@handle_errors
def verify(
    file: Path = typer.Argument(..., help="A .cmf file (its MTP sidecar, if any, is checked too)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check every tensor's CRC-32; exit 2 naming the tensors that do not match."""
    files = [CmfFile(file)]
    side = sidecar_path(file)
    problems: list[str] = []
    if files[0].header.get("role") != ROLE_SIDECAR and side.is_file() and side != Path(file):
        files.append(CmfFile(side))
        try:
            check_sidecar(files[0].header, files[1].header)
        except CortiqError as e:
            problems.append(f"{side}: {e}")
    total = sum(t.nbytes for f in files for t in f.tensors.values())
    results: list[dict[str, Any]] = []
    with Progress(
        TextColumn("[bold]verifying"),
        BarColumn(),
        BytesColumn(),
        console=err_console,
        transient=True,
        disable=json_out or not err_console.is_terminal,
    ) as bar:
        task = bar.add_task("verify", total=total)
        for f in files:
            problems += [f"{f.path}: {where} was changed" for where in f.padding_problems()]
            bad = []
            for info, ok in f.verify():
                if not ok:
                    bad.append(info.name)
                bar.advance(task, info.nbytes)
            results.append(
                {
                    "file": str(f.path),
                    "tensors": len(f.tensors),
                    "bytes": sum(t.nbytes for t in f.tensors.values()),
                    "bad": bad,
                }
            )
            f.close()
    ok = not problems and not any(r["bad"] for r in results)
    if json_out:
        print_json({"ok": ok, "files": results, "problems": problems})
    else:
        for r in results:
            mark = "[green]OK[/]" if not r["bad"] else f"[red]{len(r['bad'])} bad[/]"
            console.print(f"{r['file']}: {r['tensors']} tensors, {human_bytes(r['bytes'])} {mark}", highlight=False)
    if not ok:
        msgs = [f"checksum mismatch in {r['file']}: {', '.join(r['bad'])}" for r in results if r["bad"]] + problems
        fail("; ".join(msgs))
