"""Prompt compression for RAG prompts: tokens kept, answer retention, and TTFT on the
kvmesh engine with and without compression (passage and token methods).

Corpus: the country data shipped by the PyPI package ``countryinfo`` (MIT; one JSON per
country: capital, population, area, region, demonym, calling code, currency, time zone,
top-level domain, native name), rendered into short factual sentences; one passage =
three to four facts about one country. Nothing is fetched at run time.

Each of `--questions` questions (seed 0) asks one fact of one country; its passage (with
the answer sentence) is buried at a random position among `--min/max-distractors`
passages about other countries, which state the same kinds of facts (hard negatives).
The prompt is ``instruction <context>passages</context> question``; the compressed
conditions keep `1/--ratio` of the context tokens.

Per condition (none, passage, token) and question:

* prompt tokens the model sees (engine tokenizer) and the achieved context ratio;
* answer retention: the answer sentence survives verbatim / the answer value (e.g.
  the capital's name) survives anywhere in the compressed prompt;
* TTFT = compression (models already loaded) + add_request + steps until the first
  token, one request at a time, prefix caching off (repeats never hit a cache);
  medians over questions, then over `--repeats`.

Targets (marked met / MISSED): at 3x the passage method keeps the answer sentence in
>= 90% of questions and cuts median TTFT >= 2x.

Run on idle cores (the script prints /proc/loadavg beside the timings)::

    pip install countryinfo
    python benchmarks/compression.py                 # full: 40 questions x 3 repeats
    python benchmarks/compression.py --quick         # 5 questions, 1 repeat: checks the script

Results: benchmarks/results/compression.{json,md,png} (compression_quick.* for --quick).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from _common import RESULTS_DIR, check_idle, drain, first_output, is_idle, loadavg, md_table, write_results

OUT_DIR = RESULTS_DIR
CORPUS = "PyPI countryinfo (country JSON files, MIT)"
INSTRUCTION = "Answer the question using only the passages below. Reply with a short answer."
METHODS = ("passage", "token")
TARGETS = {"retention": 0.90, "ttft_speedup": 2.0}


@dataclass
class Fact:
    sentence: str
    question: str
    value: str


def _facts(c: dict, names: dict[str, str]) -> list[Fact]:
    """Factual sentences about one country record (only the fields it has)."""
    n, out = c["name"], []

    def add(sentence: str, question: str, value) -> None:
        out.append(Fact(sentence, question, str(value)))

    if c.get("capital"):
        add(f"The capital of {n} is {c['capital']}.", f"What is the capital of {n}?", c["capital"])
    if c.get("population"):
        add(f"{n} has a population of about {c['population']:,} people.", f"How many people live in {n}?",
            f"{c['population']:,}")
    if c.get("area"):
        add(f"{n} covers an area of {c['area']:,} square kilometres.", f"How large is {n} in square kilometres?",
            f"{c['area']:,}")
    if c.get("subregion"):
        add(f"{n} lies in {c['subregion']}.", f"In which part of the world does {n} lie?", c["subregion"])
    if c.get("demonym"):
        add(f"People from {n} are called {c['demonym']}.", f"What are people from {n} called?", c["demonym"])
    if c.get("callingCodes") and c["callingCodes"][0]:
        code = c["callingCodes"][0]
        add(f"The international calling code of {n} is +{code}.", f"What is the calling code of {n}?", f"+{code}")
    if c.get("currencies"):
        add(f"The currency code used in {n} is {c['currencies'][0]}.", f"Which currency code is used in {n}?",
            c["currencies"][0])
    if c.get("tld"):
        add(f"Web addresses in {n} end in {c['tld'][0]}.", f"What is the internet domain of {n}?", c["tld"][0])
    if c.get("nativeName") and c["nativeName"] != n:
        add(f"In its own language {n} is called {c['nativeName']}.", f"What is the native name of {n}?",
            c["nativeName"])
    borders = [names[b] for b in c.get("borders") or [] if b in names]
    if borders:
        add(f"{n} borders {', '.join(borders[:-1]) + ' and ' + borders[-1] if len(borders) > 1 else borders[0]}.",
            f"Which countries border {n}?", borders[0])
    return out


def load_corpus() -> dict[str, list[Fact]]:
    """country name -> its facts, from the countryinfo package's data folder."""
    import importlib.util

    spec = importlib.util.find_spec("countryinfo")
    if spec is None:
        raise SystemExit("the corpus comes from the PyPI package countryinfo: pip install countryinfo")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.json"))]
    records = [r for r in records if r.get("name")]
    names = {r["ISO"]["alpha3"]: r["name"] for r in records if isinstance(r.get("ISO"), dict) and "alpha3" in r["ISO"]}
    corpus = {r["name"]: _facts(r, names) for r in records}
    return {k: v for k, v in corpus.items() if len(v) >= 4}


@dataclass
class Case:
    prompt: str
    question: str
    answer: Fact


def build_cases(corpus: dict[str, list[Fact]], n: int, lo: int, hi: int, seed: int) -> list[Case]:
    """n questions, each with its answer passage among lo..hi distractor passages."""
    rng = random.Random(seed)
    countries = sorted(corpus)
    cases = []
    for country in rng.sample(countries, n):
        facts = corpus[country]
        answer = rng.choice(facts)
        others = rng.sample([f for f in facts if f is not answer], min(3, len(facts) - 1))
        mine = [answer, *others]
        rng.shuffle(mine)
        passages = []
        for other in rng.sample([c for c in countries if c != country], rng.randint(lo, hi)):
            passages.append(" ".join(f.sentence for f in rng.sample(corpus[other], min(4, len(corpus[other])))))
        passages.insert(rng.randrange(len(passages) + 1), " ".join(f.sentence for f in mine))
        prompt = f"{INSTRUCTION}\n\n<context>{chr(10).join(p + chr(10) for p in passages)}</context>\n\n" \
                 f"Question: {answer.question}\nAnswer:"
        cases.append(Case(prompt, answer.question, answer))
    return cases


def first_token_s(engine, prompt: str, method: str | None, ratio: float) -> tuple[float, int, str]:
    """(TTFT incl. compression, prompt tokens seen by the model, the prompt text)."""
    from kvmesh import SamplingParams
    from kvmesh.compress import compress_prompt

    t0 = time.perf_counter()
    text = prompt if method is None else compress_prompt(
        prompt, {"method": method, "target_ratio": ratio}, tokenizer=engine.tokenizer).text
    rid = engine.add_request(None, text, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    n = len(first_output(engine, rid).prompt_token_ids)
    dt_s = time.perf_counter() - t0
    drain(engine)
    return dt_s, n, text


def summarize(rows: dict[str, dict], questions: int) -> dict[str, dict]:
    """Per condition: medians (TTFT: over questions, then repeats), retention, speedup vs "none"."""
    summary, base = {}, None
    for cond, r in rows.items():
        ttft = statistics.median(statistics.median(x) for x in r["ttft_s"])
        base = ttft if cond == "none" else base
        summary[cond] = {
            "median_ttft_s": ttft, "ttft_speedup": base / ttft, "median_prompt_tokens": statistics.median(r["tokens"]),
            "sentence_retention": sum(r["sentence_kept"]) / questions,
            "value_retention": sum(r["value_kept"]) / questions,
            "median_context_ratio": statistics.median(r["context_ratio"]) if r["context_ratio"] else 1.0,
            "median_compress_s": statistics.median(r["compress_s"]) if r["compress_s"] else 0.0,
        }
    return summary


def run(args, load_start: list[float]) -> dict:
    """Every question under every condition; `load_start` is the load before the run began."""
    import torch
    from tqdm import tqdm

    from kvmesh import LLM, SamplingParams
    from kvmesh.compress import compress_prompt, get_compressor

    torch.set_num_threads(args.threads)
    corpus = load_corpus()
    cases = build_cases(corpus, args.questions, args.min_distractors, args.max_distractors, args.seed)
    llm = LLM(progress=False, num_threads=args.threads, enable_prefix_caching=False, max_model_len=4096,
              num_blocks=400, block_size=16, max_num_batched_tokens=4096)
    eng = llm.engine
    t0 = time.perf_counter()
    for m in METHODS:
        get_compressor(m)
    load_s = time.perf_counter() - t0
    # The request option path gives the same prompt as the library call timed here.
    opts = {"method": "passage", "target_ratio": args.ratio}
    rid = llm._add("plumbing-check", cases[0].prompt, SamplingParams(max_tokens=1), opts)
    plumbed = eng._states[rid].request.prompt_token_ids
    eng.abort(rid)
    assert plumbed == eng.encode(compress_prompt(cases[0].prompt, opts, tokenizer=eng.tokenizer).text)
    first_token_s(eng, cases[0].prompt, None, 1.0)  # warm up

    conditions = ["none", *METHODS]
    rows = {c: {"ttft_s": [[] for _ in range(args.repeats)], "tokens": [], "sentence_kept": [], "value_kept": [],
                "context_ratio": [], "compress_s": []} for c in conditions}
    loads = [load_start]  # then one after each repeat
    for rep in range(args.repeats):
        for case in tqdm(cases, desc=f"repeat {rep + 1}/{args.repeats}"):
            for cond in conditions:
                method = None if cond == "none" else cond
                t, n, text = first_token_s(eng, case.prompt, method, args.ratio)
                r = rows[cond]
                r["ttft_s"][rep].append(t)
                if rep == 0:
                    r["tokens"].append(n)
                    r["sentence_kept"].append(case.answer.sentence in text)
                    r["value_kept"].append(case.answer.value in text)
                    if method is not None:
                        res = compress_prompt(case.prompt, {"method": method, "target_ratio": args.ratio},
                                              tokenizer=eng.tokenizer)
                        r["context_ratio"].append(res.context_ratio)
                        r["compress_s"].append(res.seconds)
        loads.append(loadavg())
    summary = summarize(rows, len(cases))
    p = summary["passage"]
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"), "corpus": CORPUS, "questions": len(cases),
        "distractors": [args.min_distractors, args.max_distractors], "ratio": args.ratio, "repeats": args.repeats,
        "threads": args.threads, "quick": args.quick, "model": "SmolLM2-135M-Instruct (float32), kvmesh LLMEngine",
        "compressor_load_s": load_s, "torch": torch.__version__, "loadavg": loads, "summary": summary,
        "targets": {"passage sentence retention >= 90%": p["sentence_retention"] >= TARGETS["retention"],
                    "passage TTFT >= 2x faster": p["ttft_speedup"] >= TARGETS["ttft_speedup"]},
        "per_question": rows, "example": {"question": cases[0].question, "answer": cases[0].answer.sentence},
    }


def markdown(res: dict) -> str:
    la = res["loadavg"]
    # The start load is other people's; the later ones include this run's threads.
    busy = not (is_idle(la[0][0]) and all(is_idle(x[0], own_threads=res["threads"]) for x in la[1:]))
    lines = [f"# Prompt compression on RAG prompts ({res['ratio']:g}x target)", "",
             (f"{res['date']}, {res['model']}, torch threads {res['threads']}, {res['questions']} questions x "
              f"{res['distractors'][0]}-{res['distractors'][1]} distractor passages, corpus: {res['corpus']}, "
              f"median of {res['repeats']} repeat(s){' — QUICK settings' if res['quick'] else ''}"), "",
             (f"1-minute load average: start {la[0][0]:.2f}, end {la[-1][0]:.2f}"
              f"{' (BUSY: do not quote the timings)' if busy else ''}"), ""]
    lines += md_table(["method", "median prompt tokens", "context ratio", "answer sentence kept", "answer value kept",
                       "compress ms", "median TTFT ms", "TTFT speedup"],
                      ([cond, f"{s['median_prompt_tokens']:.0f}", f"{s['median_context_ratio']:.2f}x",
                        f"{100 * s['sentence_retention']:.0f}%", f"{100 * s['value_retention']:.0f}%",
                        f"{1e3 * s['median_compress_s']:.0f}", f"{1e3 * s['median_ttft_s']:.0f}",
                        f"{s['ttft_speedup']:.2f}x"] for cond, s in res["summary"].items()), "lrrrrrrr")
    lines += ["", ("TTFT includes compression (models preloaded: "
                   f"{res['compressor_load_s']:.1f} s once per process)."), "", "Targets:"]
    lines += [f"- {k}: {'met' if v else 'MISSED'}" for k, v in res["targets"].items()]
    return "\n".join(lines) + "\n"


def plot(plt, res: dict):
    conds = list(res["summary"])
    s = res["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bars = a.bar(conds, [1e3 * s[c]["median_ttft_s"] for c in conds], color=["#999999", "#2a9d8f", "#e76f51"])
    for bar, c in zip(bars, conds):
        a.annotate(f"{1e3 * s[c]['median_ttft_s']:.0f} ms\n{s[c]['ttft_speedup']:.2f}x",
                   (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    a.set_ylabel("median TTFT (ms, incl. compression)")
    a.set_title(f"TTFT at {res['ratio']:g}x compression")
    x = range(len(conds))
    b.bar([i - 0.2 for i in x], [100 * s[c]["sentence_retention"] for c in conds], 0.4, label="answer sentence")
    b.bar([i + 0.2 for i in x], [100 * s[c]["value_retention"] for c in conds], 0.4, label="answer value")
    b.set_xticks(list(x), conds)
    b.set_ylabel("% of questions")
    b.set_ylim(0, 105)
    b.axhline(100 * TARGETS["retention"], color="k", ls=":", lw=1)
    b.legend(loc="lower left")
    b.set_title("answer retention")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--min-distractors", type=int, default=10)
    ap.add_argument("--max-distractors", type=int, default=20)
    ap.add_argument("--ratio", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="5 questions, 1 repeat: checks the script end to end")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    args = ap.parse_args()
    if args.quick:
        args.questions, args.repeats = min(args.questions, 5), 1
    load_start = loadavg()
    check_idle(args.threads, load_start[0])
    res = run(args, load_start)
    md = markdown(res)
    write_results("compression_quick" if args.quick else "compression", res, md, plot, args.out_dir)
    print(md)


if __name__ == "__main__":
    main()
