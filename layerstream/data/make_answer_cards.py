"""Writes answer-cards-train.jsonl and answer-cards-eval.jsonl beside this file: the bundled fine-tuning
set of `layerstream finetune-demo`.

Each example is one user question and an assistant reply in a fixed format that the base SmolLM2 never
uses unprompted, a one-line JSON card:

    {"answer": "Paris", "topic": "geography"}

The questions come from small fact tables written for the project (arithmetic, capitals, opposites,
plurals, unit conversions, colours, animal sounds, days and months), phrased in several ways. The split is by fact, not
by phrasing: every eval fact is absent from the training set, so the eval set measures the format learned,
not answers remembered. Deterministic (a fixed seed); rerun after editing a table:

    python -m layerstream.data.make_answer_cards
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TRAIN, EVAL = HERE / "answer-cards-train.jsonl", HERE / "answer-cards-eval.jsonl"

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
            ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
            ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
            ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
            ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Greece", "Athens"), ("Ireland", "Dublin"),
            ("Russia", "Moscow"), ("Turkey", "Ankara"), ("Australia", "Canberra"), ("Thailand", "Bangkok"),
            ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Cuba", "Havana"), ("Hungary", "Budapest")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("light", "dark"),
             ("happy", "sad"), ("early", "late"), ("full", "empty"), ("open", "closed"), ("hard", "soft"),
             ("old", "young"), ("rich", "poor"), ("wet", "dry"), ("strong", "weak"), ("loud", "quiet"),
             ("tall", "short"), ("thick", "thin"), ("inside", "outside"), ("first", "last"), ("win", "lose"),
             ("push", "pull"), ("buy", "sell"), ("day", "night"), ("north", "south")]
PLURALS = [("child", "children"), ("mouse", "mice"), ("foot", "feet"), ("tooth", "teeth"), ("man", "men"),
           ("woman", "women"), ("goose", "geese"), ("person", "people"), ("box", "boxes"), ("city", "cities"),
           ("leaf", "leaves"), ("knife", "knives"), ("wolf", "wolves"), ("potato", "potatoes"),
           ("bus", "buses"), ("baby", "babies"), ("sheep", "sheep"), ("fish", "fish"), ("cactus", "cacti"),
           ("ox", "oxen")]
COLOURS = [("a ripe banana", "yellow"), ("grass", "green"), ("the sky on a clear day", "blue"),
           ("snow", "white"), ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"),
           ("a lemon", "yellow"), ("a flamingo", "pink"), ("chocolate", "brown"), ("an emerald", "green"),
           ("a ruby", "red"), ("milk", "white"), ("a crow", "black"), ("a pumpkin", "orange"),
           ("a sapphire", "blue")]
SOUNDS = [("dog", "woof"), ("cat", "meow"), ("cow", "moo"), ("sheep", "baa"), ("duck", "quack"),
          ("owl", "hoot"), ("lion", "roar"), ("snake", "hiss"), ("pig", "oink"), ("horse", "neigh"),
          ("bee", "buzz"), ("frog", "croak"), ("mouse", "squeak"), ("donkey", "hee-haw")]

PHRASES = {
    "geography": ["What is the capital of {0}?", "Which city is the capital of {0}?",
                  "Name the capital city of {0}.", "{0}'s capital is which city?"],
    "arithmetic": ["What is {0} {op} {1}?", "Compute {0} {op} {1}.", "How much is {0} {op} {1}?",
                   "Calculate {0} {op} {1} for me."],
    "language": ["What is the opposite of '{0}'?", "Give the antonym of '{0}'.",
                 "Which word means the opposite of '{0}'?"],
    "grammar": ["What is the plural of '{0}'?", "How do you write more than one '{0}'?",
                "Give the plural form of '{0}'."],
    "units": ["How many {1} are in {0} {2}?", "Convert {0} {2} to {1}.", "{0} {2} is how many {1}?"],
    "colours": ["What colour is {0}?", "Which colour is {0} usually?", "Tell me the colour of {0}."],
    "calendar": ["What comes after {0}?", "Which {1} follows {0}?", "Name the {1} after {0}."],
    "animals": ["What sound does a {0} make?", "How does a {0} sound?", "Which noise does a {0} make?"],
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("minutes", "seconds", 60),
         ("kilograms", "grams", 1000), ("metres", "centimetres", 100), ("days", "hours", 24),
         ("weeks", "days", 7), ("litres", "millilitres", 1000)]


def facts(rng: random.Random) -> list[tuple[str, str, str]]:
    """(topic, question, answer) for every fact, one phrasing each."""
    out = []

    def add(topic: str, answer: str, *args, **kw) -> None:
        out.append((topic, rng.choice(PHRASES[topic]).format(*args, **kw), answer))

    for country, city in CAPITALS:
        add("geography", city, country)
    sums = set()
    while len(sums) < 75:  # distinct facts: a fact is in one split only
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        op, value = rng.choice([("+", a + b), ("-", a - b), ("times", a * b)])
        if (a, op, b) not in sums:
            sums.add((a, op, b))
            add("arithmetic", str(value), a, b, op=op)
    for word, opposite in OPPOSITES:
        add("language", opposite, word)
    for word, plural in PLURALS:
        add("grammar", plural, word)
    conversions = set()
    while len(conversions) < 40:
        big, small, factor = rng.choice(UNITS)
        n = rng.randint(2, 12)
        if (n, big) not in conversions:
            conversions.add((n, big))
            add("units", str(n * factor), n, small, big)
    for thing, colour in COLOURS:
        add("colours", colour, thing)
    for animal, sound in SOUNDS:
        add("animals", sound, animal)
    for names, unit in ((DAYS, "day"), (MONTHS, "month")):
        for i, name in enumerate(names):
            add("calendar", names[(i + 1) % len(names)], name, unit)
    return out


def card(answer: str, topic: str) -> str:
    return json.dumps({"answer": answer, "topic": topic})


def main() -> None:
    rng = random.Random(20261205)
    rows = facts(rng)
    rng.shuffle(rows)
    eval_rows, train_rows = rows[:40], rows[40:]
    for path, part in ((TRAIN, train_rows), (EVAL, eval_rows)):
        with open(path, "w") as f:
            for topic, question, answer in part:
                f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": card(answer, topic)}]}) + "\n")
        print(f"{path.name}: {len(part)} examples")


if __name__ == "__main__":
    main()
