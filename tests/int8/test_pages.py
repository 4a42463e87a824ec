"""A report dict as a markdown page (tritonkit.int8.pages): pure, so built by hand here."""

from __future__ import annotations

from tritonkit.int8 import pages


def _report(**extra) -> dict:
    return {"model": "tiny", "form": "served", "status": "passed", "created": "2026-11-26T01:00:00",
            "env": {"packages": {"onnxruntime": "1.23.2"}, "cpu_int8_features": ["avx512_vnni"]},
            "recipe_summary": "uint8-all-minmax +1 float", "recipe_file": "models/tiny.int8.json",
            "recipe": {"float_nodes": ["/head/MatMul"]},
            "gates": [{"metric": "cosine_min", "op": ">=", "value": 0.99, "absolute": 0.99, "validation": 0.985,
                       "test": 0.986},
                      {"metric": "int8_speedup", "op": ">=", "value": 1.3}],
            "floor": {"precision": "bf16", "how": "OpenVINO", "validation": {"cosine_min": 0.9950},
                      "test": {"cosine_min": 0.9960}},
            "validation": {"cosine_min": 0.9931}, "test": {"cosine_min": 0.9942},
            "speed": {"int8_speedup": 1.41, "fp32_ms_batch8": 10.0, "int8_ms_batch8": 7.1, "speedup_batch8": 1.41},
            **extra}


def test_a_page_puts_gate_floor_bound_and_result_side_by_side():
    page = pages.render_markdown(_report())
    assert page.startswith("# tiny INT8 (served form): PASSED")
    assert "| cosine_min >= | 0.99 | 0.9950 / 0.9960 | 0.985 / 0.986 | 0.9931 / 0.9942 |" in page
    assert "| int8_speedup >= | 1.3 | | | 1.4100 |" in page
    assert "| 8 | 10.00 | 7.10 | 1.41 |" in page and "Kept in float (1): `/head/MatMul`" in page


def test_a_fallback_page_says_so_and_a_search_lists_its_steps_and_time():
    step = {"stage": "start", "change": "form=int8", "recipe": "int8-all", "seconds": 60.0, "distortion": 1.5,
            "passed": False}
    search = {"seconds": 100.0, "steps": [step],
              "sensitivity": [{"recipe": "int8-all", "seconds": 30.0, "units": [{"unit": "layer.0", "gain": 0.7}]}]}
    page = pages.render_markdown(_report(served="fp32", status="fp32-fallback", reason="no candidate passed",
                                         search=search))
    assert "**No INT8 candidate passed; the FP32 model is served.** no candidate passed" in page
    assert "| start | form=int8 | int8-all | 1.500 | no |  |" in page
    assert "Time by stage: start 60 s, sensitivity 30 s, other 10 s" in page
    assert "`layer.0` 0.700" in page
    assert pages.stage_seconds(search) == {"start": 60.0, "sensitivity": 30.0, "other": 10.0}
    no_floor = pages.render_markdown(_report(floor={"precision": "bf16", "unavailable": "no bf16 on this CPU"}))
    assert "No bf16 floor here (no bf16 on this CPU): the absolute gates decide." in no_floor


def test_a_page_lists_what_the_budget_cut():
    step = {"stage": "start", "change": "form=int8", "recipe": "int8-all", "seconds": 60.0, "distortion": 1.5,
            "passed": False}
    cuts = [{"stage": "variant:sample", "what": "smooth_alpha=0.5", "estimate_s": 41.2, "left_s": 12.0,
             "reserve_s": 90.0, "at_s": 798.4},
            {"stage": "speed", "what": "uint8-all-minmax +3 float", "estimate_s": None, "left_s": 0.0}]
    page = pages.render_markdown(_report(search={"seconds": 900.0, "steps": [step], "cuts": cuts}))
    assert "Cut by the budget" in page
    assert "- variant:sample `smooth_alpha=0.5` at 798 s: about 41 s, 12 s left" in page
    assert "- speed `uint8-all-minmax +3 float`: 0 s left" in page
    assert "Cut by the budget" not in pages.render_markdown(_report(search={"seconds": 1.0, "steps": [step]}))
    # A scan the budget cut before its first unit ranks nothing: no empty ranking line.
    unranked = {"seconds": 900.0, "steps": [step], "cuts": cuts,
                "sensitivity": [{"recipe": "int8-all", "seconds": 0.0, "units": [], "unmeasured": ["layer.0"]}]}
    assert "Most sensitive units" not in pages.render_markdown(_report(search=unranked))


def test_the_docs_page_is_brief_and_names_the_recipes_cpu():
    step = {"stage": "start", "change": "form=int8", "recipe": "int8-all", "seconds": 60.0, "distortion": 1.5,
            "passed": False}
    report = _report(search={"seconds": 100.0, "steps": [step], "cuts": [{"stage": "speed", "what": "x",
                                                                          "left_s": 0.0}]},
                     recipe_cpu="the vnni search's accurate candidate; this CPU has no native bf16")
    page = pages.render_markdown(report, brief=True)
    assert "Made " not in page and "| start |" not in page
    assert "Kept in float (1): listed in `models/tiny.int8.json`" in page
    assert "Search: 100.0 s, 1 step (start 60 s, sensitivity 0 s, other 40 s); 1 cut by the budget" in page
    assert "Recipe's CPU: the vnni search's accurate candidate; this CPU has no native bf16." in page
    assert "Made " in pages.render_markdown(report) and "| start |" in pages.render_markdown(report)
