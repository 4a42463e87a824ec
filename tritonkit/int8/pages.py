"""A report of an INT8 build or search as a markdown page: gates beside the half-precision floor, metrics per
split, speed per batch, the units kept in float and the search's steps. Pure: a report dict in, text out;
tritonkit.int8.report writes these pages and assembles docs/int8.md from them."""

from __future__ import annotations


def _floor_lines(report: dict) -> list[str]:
    """Gates beside the half-precision floor: absolute bound, floor, the bound judged against it, INT8's result."""
    half = report.get("floor") or {}
    if "unavailable" in half:
        head = [f"No {half.get('precision')} floor here ({half['unavailable']}): the absolute gates decide.", ""]
    elif "not_needed" in half:
        head = [f"The {half.get('precision')} floor was {half['not_needed']}.", ""]
    elif half:
        head = [f"Floor: the FP32 graph at {half['precision']} ({half.get('how')}), scored like INT8. A gate passes "
                "within the kind's slack of the floor or at the absolute bound, whichever is looser, never below the "
                "catastrophe bounds (tritonkit.int8.floor).", ""]
    else:
        head = []
    lines = [*head, "| gate | absolute | floor val / test | bound val / test | INT8 val (search) / test |",
             "|---|---|---|---|---|"]
    for g in report["gates"]:
        m = g["metric"]
        if m.startswith("int8_speedup"):
            lines.append(f"| {m} {g['op']} | {g['value']} | | | {_f(report.get('speed', {}).get(m))} |")
            continue
        floor = " / ".join(_f((half.get(split) or {}).get(m)) for split in ("validation", "test")) if half else ""
        bound = f"{g.get('validation', g['value'])} / {g.get('test', g['value'])}"
        got = " / ".join(_f(report.get(split, {}).get(m)) for split in ("validation", "test"))
        absolute = g.get("absolute", g["value"])
        lines.append(f"| {m} {g['op']} | {'catastrophe only' if absolute is None else absolute} | {floor} | {bound} "
                     f"| {got} |")
    return lines


def render_markdown(report: dict, brief: bool = False) -> str:
    """A readable page: gates, metrics per split, speed per batch, float units and the search's steps. `brief` (the
    docs' page, whose head names the environment): no environment line, float units counted, the search in a line."""
    lines = [f"# {report['model']} INT8 ({report['form']} form): {report['status'].upper()}", ""]
    env = report.get("env", {})
    if not brief:
        lines += [f"Made {report['created']} with "
                  f"{', '.join(f'{k} {v}' for k, v in env.get('packages', {}).items())}; "
                  f"CPU INT8 features: {', '.join(env.get('cpu_int8_features', [])) or 'none'}.", ""]
    if report.get("recipe_cpu"):
        lines += [f"Recipe's CPU: {report['recipe_cpu']}.", ""]
    if report.get("served") == "fp32":
        lines += [f"**No INT8 candidate passed; the FP32 model is served.** {report.get('reason', '')}", ""]
    else:
        lines += [f"Recipe: `{report.get('recipe_summary')}` from `{report['recipe_file']}`.", ""]
        lines += _floor_lines(report)
        speed = report.get("speed", {})
        if speed:
            lines += ["", "| batch | FP32 ms | INT8 ms | speed-up | 95 % interval |", "|---|---|---|---|---|"]
            for k in speed:
                if k.startswith("speedup_batch"):
                    b = k.removeprefix("speedup_batch")
                    lo, hi = speed.get(f"speedup_lo_batch{b}"), speed.get(f"speedup_hi_batch{b}")
                    lines.append(f"| {b} | {speed[f'fp32_ms_batch{b}']:.2f} | {speed[f'int8_ms_batch{b}']:.2f} | "
                                 f"{speed[k]:.2f} | {f'{lo:.2f}–{hi:.2f}' if lo is not None else '—'} |")
        recipe = report.get("recipe") or {}
        dynamic = recipe.get("dynamic") or {}
        float_nodes = [n for n in recipe.get("float_nodes", []) if n not in dynamic.get("nodes", ())]
        for what, nodes in [("Kept in float", float_nodes),
                            (f"Activations quantized at run time, {dynamic.get('scheme')}", dynamic.get("nodes"))]:
            if nodes is None:
                continue
            names = f"listed in `{report['recipe_file']}`" if brief and nodes else \
                (", ".join(f"`{n}`" for n in nodes) or "none")
            lines += ["", f"{what} ({len(nodes)}): {names}"]
        if report.get("int8_mac_share") is not None:
            lines += ["", f"Weighted multiply-accumulates in INT8: {report['int8_mac_share']:.1%}."]
        if report.get("missed"):
            lines += ["", "Missed: " + "; ".join(report["missed"])]
    search = report.get("search", {})
    if brief and search.get("steps"):
        n = len(search["steps"])
        lines += ["", f"Search: {search.get('seconds')} s, {n} step{'' if n == 1 else 's'} ("
                  + ", ".join(f"{k} {v:.0f} s" for k, v in stage_seconds(search).items())
                  + f"); {len(search.get('cuts') or [])} cut by the budget, {len(search.get('walls') or [])} ended "
                  "by the speed gate; every step in build/reports/ where it ran."]
    elif search.get("steps"):
        lines += ["", f"## Search ({search.get('seconds')} s on the validation split)", "",
                  "| stage | change | recipe | distortion | passed | speed-up |", "|---|---|---|---|---|---|"]
        for s in search["steps"]:
            # A graph the form rejected, or a start too slow to score (its speed-up is there), has no distortion.
            scored = f"{s['distortion']:.3f}" if s["distortion"] != float("inf") else "rejected" \
                if s.get("speedup") is None else "not scored"
            lines.append(f"| {s['stage']} | {s['change']} | {s['recipe']} | {scored} | "
                         f"{'yes' if s['passed'] else 'no'} | {_f(s.get('speedup'))} |")
        lines += ["", "Time by stage: " + ", ".join(f"{k} {v:.0f} s" for k, v in stage_seconds(search).items())]
        if search.get("cuts"):
            lines += ["", "Cut by the budget (not started: its estimate did not fit in what was left, less the reserve "
                      "for a found candidate's checks; an option is skipped alone, a fallback step ends the search):",
                      ""]
            lines += [_cut(c) for c in search["cuts"]]
        if search.get("walls"):
            lines += ["", "Ended by the speed gate (the prefix missed accuracy and already ran under the gate; longer "
                      "prefixes are only slower):", ""]
            lines += [_wall(w) for w in search["walls"]]
        for sens in search.get("sensitivity") or []:
            top = sens["units"][:8]
            if not top:  # the budget cut the scan before its first unit
                continue
            lines += ["", f"Most sensitive units for `{sens['recipe']}` (distortion recovered when left float): "
                      + ", ".join(f"`{u['unit']}` {u['gain']:.3f}" for u in top)]
    return "\n".join(lines) + "\n"


def _wall(w: dict) -> str:
    b, sp = w["batch"], w["speed"]
    return (f"- `{w['recipe']}` at batch {b}: x{sp[f'speedup_batch{b}']:.2f} "
            f"[{sp[f'speedup_lo_batch{b}']:.2f}, {sp[f'speedup_hi_batch{b}']:.2f}]")


def _cut(c: dict) -> str:
    at = f" at {c['at_s']:.0f} s" if c.get("at_s") is not None else ""
    about = f"about {c['estimate_s']:.0f} s, " if c.get("estimate_s") is not None else ""
    return f"- {c['stage']} `{c['what']}`{at}: {about}{c['left_s']:.0f} s left"


def stage_seconds(search: dict) -> dict[str, float]:
    """Where a search's time went: its measured steps by stage, the sensitivity scans, and the rest (calibration
    outside steps, the final speed and test-split runs)."""
    out: dict[str, float] = {}
    for s in search.get("steps") or []:
        out[s["stage"]] = out.get(s["stage"], 0.0) + s.get("seconds", 0.0)
    out["sensitivity"] = sum(x.get("seconds", 0.0) for x in search.get("sensitivity") or [])
    out["other"] = max(0.0, (search.get("seconds") or 0.0) - sum(out.values()))
    return out


def _f(v) -> str:
    return "" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)
