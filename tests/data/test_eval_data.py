"""Held-out evaluation data for the INT8 gates: the text corpus and the photo set (no server, no model).

Bounds are the promises of the data README (>= 3,000 texts from >= 5 sources, every kind >= 10 %, >= 300
photos, 20/40/40 photo splits); kinds are re-measured here with the MiniLM tokenizer, not read from the file.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import numpy as np
import pytest

from tritonkit import data
from tritonkit.data import make_eval_corpus, photos

MIN_TEXTS = 3000
MIN_SOURCES = 5
MIN_KIND_SHARE = 0.10
MIN_PHOTOS = 300
SHINGLE = 8  # words: a run this long shared with the calibration text means it leaked in


@pytest.fixture(scope="module")
def corpus() -> tuple[data.EvalText, ...]:
    return data.eval_corpus()


@pytest.fixture(scope="module")
def token_count():
    return make_eval_corpus.token_counter()


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _shingles(text: str) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


def test_corpus_size_sources_and_measured_kinds(corpus, token_count):
    assert len(corpus) >= MIN_TEXTS
    assert len({t.source for t in corpus}) >= MIN_SOURCES
    measured = Counter()
    for t in corpus:
        words, tokens = len(t.text.split()), token_count(t.text)
        if words <= make_eval_corpus.QUERY_WORDS:
            measured["query"] += 1
        elif tokens > make_eval_corpus.PASSAGE_TOKENS:
            measured["passage"] += 1
        elif len(make_eval_corpus.sentences_of(t.text)) == 1:
            measured["sentence"] += 1
        # The recorded kind is the measured one (passages really are over 128 tokens, queries <= 6 words).
        assert (t.kind == "query") == (words <= make_eval_corpus.QUERY_WORDS), t
        assert (t.kind == "passage") == (words > make_eval_corpus.QUERY_WORDS
                                         and tokens > make_eval_corpus.PASSAGE_TOKENS), t
    for kind in ("query", "sentence", "passage"):
        assert measured[kind] / len(corpus) >= MIN_KIND_SHARE, (kind, measured)


def test_splits_disjoint_and_stratified(corpus):
    val, test = data.eval_items("validation"), data.eval_items("test")
    assert len(val) + len(test) == len(corpus)
    assert not {t.text.lower() for t in val} & {t.text.lower() for t in test}
    assert len({t.text.lower() for t in corpus}) == len(corpus)  # no duplicates at all
    strata_val = Counter((t.source, t.kind) for t in val)
    strata_test = Counter((t.source, t.kind) for t in test)
    assert set(strata_val) == set(strata_test)
    for key in strata_val:
        assert abs(strata_val[key] - strata_test[key]) <= 1, key
    assert data.eval_texts("validation") == [t.text for t in val]
    with pytest.raises(KeyError, match="calibration"):
        data.eval_items("calibration")  # calibration text is sentences.txt, never this corpus


def test_no_calibration_text_in_corpus(corpus):
    calibration = set()
    for line in data.sentences():
        calibration |= _shingles(line)
    leaked = [t.text for t in corpus if _shingles(t.text) & calibration]
    assert not leaked, leaked[:3]
    exact = {" ".join(_words(s)) for s in data.sentences()}
    assert not [t.text for t in corpus if " ".join(_words(t.text)) in exact]


@pytest.mark.slow  # rebuilds the whole corpus from the installed packages
def test_maker_reproduces_committed_corpus():
    """The committed file is what the maker makes from the installed packages (seeded, no hidden edits)."""
    rows = make_eval_corpus.build()
    assert make_eval_corpus.serialize(rows) == data.EVAL_CORPUS.read_text(encoding="utf-8")


# -- photos ----------------------------------------------------------------------------------------------------

def test_manifest_matches_installed_files():
    photos.check()
    entries = photos.manifest()
    assert [(e.source, e.path) for e in entries] == sorted((e.source, e.path) for e in entries)
    assert len({e.sha256 for e in entries}) == len(entries)  # distinct files
    assert len({e.group for e in entries}) >= MIN_PHOTOS  # distinct scenes
    for e in entries[:: max(1, len(entries) // 25)]:  # the recorded hash is the file's, independently computed
        assert hashlib.sha256(photos.resolve(e).read_bytes()).hexdigest() == e.sha256


def test_changed_photo_is_named(tmp_path, monkeypatch):
    entry = photos.manifest()[0]
    bad = photos.MANIFEST.read_text(encoding="utf-8").replace(entry.sha256, "0" * 64)
    manifest = tmp_path / "photos_manifest.tsv"
    manifest.write_text(bad, encoding="utf-8")
    monkeypatch.setattr(photos, "MANIFEST", manifest)
    photos.manifest.cache_clear()
    try:
        with pytest.raises(photos.PhotoDataError, match=re.escape(entry.name)):
            photos.check()
    finally:
        photos.manifest.cache_clear()


def test_photo_splits_disjoint_by_scene_and_sized():
    split_entries = {s: photos.entries(s) for s in photos.SPLITS}
    total = sum(len(es) for es in split_entries.values())
    assert total == len(photos.manifest())
    groups = {s: {e.group for e in es} for s, es in split_entries.items()}
    for a in photos.SPLITS:
        for b in photos.SPLITS:
            if a < b:
                assert not groups[a] & groups[b], (a, b)
    share = {s: len(es) / total for s, es in split_entries.items()}
    assert 0.15 <= share["calibration"] <= 0.25 and 0.35 <= share["validation"] <= 0.45, share
    assert 0.35 <= share["test"] <= 0.45, share
    # Every source with enough scenes reaches both held-out splits.
    for source, n in Counter(e.source for e in photos.manifest()).items():
        if n >= 5:
            for s in ("validation", "test"):
                assert any(e.source == source for e in split_entries[s]), (source, s)


def test_photos_decode_shrink_and_composite():
    ps = photos.photos("validation")
    assert len(ps) == len(photos.entries("validation"))
    for p in ps:
        assert p.rgb.dtype == np.uint8 and p.rgb.ndim == 3 and p.rgb.shape[2] == 3, p.name
        assert 64 <= min(p.rgb.shape[:2]) <= photos.MAX_SIDE, (p.name, p.rgb.shape)
    # A Tux Paint stamp is a cutout: its transparent corner is the neutral background, not black.
    stamp = next(p for p in ps if "tuxpaint" in p.source)
    assert tuple(stamp.rgb[0, 0]) == photos.BACKGROUND
    # A large wallpaper comes down to MAX_SIDE on its shorter side.
    wall = next(p for p in ps if "backgrounds" in p.source)
    assert min(wall.rgb.shape[:2]) == photos.MAX_SIDE


def test_views_are_deterministic_crops_and_flips():
    names = ("full", "flip", "center50")
    vs = photos.views("test", names)
    assert len(vs) == len(names) * len(photos.entries("test"))
    full, flip, center = vs[0].rgb, vs[1].rgb, vs[2].rgb
    assert np.array_equal(flip, full[:, ::-1])
    h, w = full.shape[:2]
    assert np.array_equal(center, full[int(0.25 * h):round(0.75 * h), int(0.25 * w):round(0.75 * w)])
    assert [v.name for v in vs] == [v.name for v in photos.views("test", names)]
    with pytest.raises(KeyError, match="nope"):
        photos.views("test", ("nope",))
