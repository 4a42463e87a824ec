"""The INT8 stage's reports: each form's build report (build/reports/<name>_int8*.json + .md), what serve, demo
and the docs read back from them, and the docs' INT8 pages.

    python -m tritonkit.int8.report docs     regenerate this CPU class's INT8 page and README table
    python -m tritonkit.int8.report check    refuse (exit 2) an INT8 model that must not be served here

Reports render the stage's records; they never measure anything.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.int8.pages import render_markdown
from tritonkit.int8.recipe import FALLBACK, FORMS, load_recipes, recipe_path, search_command

REPORTS = paths.REPORTS


def report_path(kind, form: str = "served") -> Path:
    return REPORTS / f"{kind.NAME}_int8{'' if form == 'served' else '_trt'}.json"


def search_summary(kind, form: str) -> dict:
    """The search's steps and float units, from its report when this machine ran it."""
    path = REPORTS / f"{kind.NAME}_int8_search.json"
    if not path.exists():
        return {"note": f"search report not on this machine; re-run with `{search_command(kind)}`"}
    full = json.loads(path.read_text())["search"].get(form, {})
    return {k: full.get(k) for k in ("steps", "sensitivity", "best_failed", "seconds", "speed", "cuts", "walls")}


def loud(msg: str) -> None:
    bar = "!" * 100
    print(f"{bar}\n[int8] WARNING: {msg}\n{bar}", file=sys.stderr, flush=True)


def write(kind, form: str, report: dict) -> None:
    from tritonkit.export import write_json

    path = report_path(kind, form)
    write_json(path, report)
    path.with_suffix(".md").write_text(render_markdown(report))
    print(render_markdown(report), flush=True)


def served_label(name: str) -> str:
    """What model `name`'s INT8 name serves, for labels: "INT8", or "FP32 fallback" when the build here served the
    FP32 graph under the INT8 name (its report says so), else when the committed served-form search found none."""
    from tritonkit import kinds

    kind = kinds.get(name)
    report = report_path(kind)
    if report.exists():
        status = json.loads(report.read_text()).get("status")
    else:
        served = (load_recipes(kind) or {}).get("served")
        status = served.status if served else None
    return "FP32 fallback" if status == FALLBACK else "INT8"


def floor_summary(name: str) -> str:
    """One line on the served form's gates, from this build's report: INT8's test-split result beside the
    half-precision floor and the gate it set, or why the FP32 graph is served, with the floor beside."""
    from tritonkit import kinds

    kind = kinds.get(name)
    path = report_path(kind)
    if not path.exists():
        return "no INT8 report yet"
    report = json.loads(path.read_text())
    half = report.get("floor") or {}
    floor_test = half.get("test", {})
    bounds = {g["metric"]: g.get("test", g["value"]) for g in report.get("gates", [])}
    cells = []
    for t in kind.TARGETS:
        got = report.get("test", {}).get(t.metric)
        cell = t.metric + (f" {got:.4f}" if got is not None else "")
        if t.metric in floor_test:
            cell += f" (floor {floor_test[t.metric]:.4f}, gate {bounds.get(t.metric, t.value):.4f})"
        cells.append(cell)
    if "test" in half:
        where = f"beside the {half['precision']} floor"
    elif "not_needed" in half:
        where = f"absolute gates (the {half['precision']} floor {half['not_needed']})"
    else:
        where = f"absolute gates ({half.get('unavailable') or 'a report from before floors: rebuild'})"
    if report.get("status") == FALLBACK:
        return f"no INT8 candidate met its gates ({report.get('reason', '')[:160]}); {where}: " + "; ".join(cells)
    return f"INT8, test split, {where}: " + "; ".join(cells)


def served_problems(kind) -> list[str]:
    """Why the served INT8 model of `kind` must not be served here (empty: fine). FP32 fallback is allowed."""
    path = report_path(kind)
    fix = f"run `make build` (replays models/{kind.NAME}.int8.json) or `{search_command(kind)}`"
    if not path.exists():
        return [f"{kind.NAME}: no INT8 report ({paths.rel(path)}); {fix}"]
    report = json.loads(path.read_text())
    if report.get("status") == FALLBACK:
        return []
    problems = []
    if not report.get("passed"):
        problems.append(f"{kind.NAME}: INT8 missed {', '.join(report.get('missed', [])) or 'its gates'}; "
                        f"re-run the search: `{search_command(kind)}`")
    diffs = envinfo.differences(report.get("env", {}))
    if diffs:
        problems.append(f"{kind.NAME}: INT8 report was made with {'; '.join(diffs)}; {fix}")
    return problems


def check_all(names: list[str] | None = None) -> list[str]:
    """Problems of every registered model's served INT8 (empty: all may be served)."""
    from tritonkit import kinds

    return [p for name in (names or kinds.names()) for p in served_problems(kinds.get(name))]


README_MARKERS = ("<!-- int8-results:begin (python -m tritonkit.int8.report docs) -->", "<!-- int8-results:end -->")


def docs_page(cpu: str) -> Path:
    """The full reports of one CPU INT8 class: docs/int8.md for VNNI (the reference machine), docs/int8-<class>.md
    for the others."""
    return paths.ROOT / "docs" / ("int8.md" if cpu == "vnni" else f"int8-{cpu}.md")


def _class_tables(block: str) -> dict[str, str]:
    """CPU class -> its table in README's INT8 block (each starts with a "CPU INT8 class `x`" line)."""
    import re

    heads = list(re.finditer(r"^CPU INT8 class `(\w+)`", block, flags=re.M))
    return {m.group(1): block[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(block)].strip()
            for i, m in enumerate(heads)}


def docs(readme: Path = paths.ROOT / "README.md", out: Path | None = None) -> Path:
    """This CPU class's page of full reports (docs_page) and its table in README's INT8 block, from
    build/reports/; the other classes' tables stay as their machines wrote them."""
    import hashlib

    from tritonkit import kinds

    cpu = envinfo.int8_class()
    out = out or docs_page(cpu)

    lock = paths.ROOT / "requirements.lock"
    lock_id = f"requirements.lock sha256 {hashlib.sha256(lock.read_bytes()).hexdigest()[:12]}" if lock.exists() \
        else "no lock file"
    env = envinfo.fingerprint()
    head = (f"Regenerated by `python -m tritonkit.int8.report docs` from build/reports/ on "
            f"{time.strftime('%Y-%m-%d')}; environment {lock_id}; CPU INT8 features "
            f"{', '.join(env['cpu_int8_features']) or 'none'} ({env['machine']}).")
    pages, rows = [f"# INT8 results\n\n{head}\n"], []
    for name in kinds.names():
        kind = kinds.get(name)
        for form in FORMS:
            path = report_path(kind, form)
            if not path.exists():
                continue
            report = json.loads(path.read_text())
            page = render_markdown(report, brief=True).replace("# ", "## ", 1)
            if not (report.get("search") or {}).get("steps"):  # the search's log is history: git keeps it
                page += (f"\n_This build replayed the committed recipe ({paths.rel(recipe_path(kind))}); the "
                         f"search that made it is in the git history of {paths.rel(out)}._\n")
            pages.append(page)
            test, half = report.get("test", {}), (report.get("floor") or {}).get("test", {})
            bounds = {g["metric"]: g.get("test", g["value"]) for g in report.get("gates", [])}
            # Result, then the floor and the bound it sets (a bare result: no floor on this CPU, absolute gates).
            accuracy = ", ".join(f"{t.metric} {test[t.metric]:.4f}"
                                 + (f" ({half[t.metric]:.4f}, {bounds.get(t.metric, t.value):.4f})"
                                    if t.metric in half else "") for t in kind.TARGETS if t.metric in test)
            speed = report.get("speed", {}).get("int8_speedup")
            rows.append(f"| {kind.NAME} | {form} | {report['status']} | `{report.get('recipe_summary', 'FP32')}` | "
                        f"{accuracy or '-'} | {f'{speed:.2f}x' if speed else '-'} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(pages))
    page = paths.rel(out)
    table = "\n".join([f"CPU INT8 class `{cpu}`. {head}", "",
                       "| model | form | status | recipe | test split: INT8 (half-precision floor, gate) | "
                       "INT8 vs FP32 (slowest batch) |",
                       "|---|---|---|---|---|---|", *rows, "", f"Full reports and the search steps: [{page}]({page})."])
    text = readme.read_text()
    begin, end = README_MARKERS
    if begin in text and end in text:
        tables = _class_tables(text[text.index(begin) + len(begin): text.index(end)])
        tables[cpu] = table
        block = "\n\n".join(tables[c] for c in sorted(tables, key=lambda c: (c != "vnni", c)))
        text = text[: text.index(begin) + len(begin)] + "\n" + block + "\n" + text[text.index(end):]
        readme.write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.report", description="INT8 gates and reports")
    sub = parser.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="refuse (exit 2) an INT8 model that must not be served here")
    check.add_argument("models", nargs="*", help="build targets (default: all)")
    sub.add_parser("docs", help="regenerate this CPU class's INT8 page (docs/int8.md for VNNI) and README table")
    args = parser.parse_args(argv)
    if args.cmd == "docs":
        print(f"wrote {paths.rel(docs())}")
        return 0
    problems = check_all(args.models or None)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
