"""A procedural set of grade-school math word problems: a stand-in for GSM8K, which no installed package
ships. Deterministic (seeded), so every run and every machine evaluates the same prompts.

The instruction suffix is the one published DFlash benchmarks append to GSM8K and MATH-500 questions.
"""

from __future__ import annotations

import random

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena")
ITEMS = ("apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "stamps")


def _shop(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, paid = rng.randint(3, 12), rng.randint(2, 9), rng.randint(100, 200)
    return (f"{name} buys {count} packs of {item}. Each pack costs ${price}. {name} pays with ${paid}. "
            f"How much change does {name} get?")


def _share(rng: random.Random) -> str:
    name, other, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    total, given = rng.randint(40, 120), rng.randint(2, 9)
    return (f"{name} has {total} {item}. {name} gives {given} to each of 4 friends, then gives half of the rest "
            f"to {other}. How many {item} does {name} keep?")


def _rate(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    speed, hours, extra = rng.randint(30, 70), rng.randint(2, 6), rng.randint(10, 60)
    return (f"{name} drives at {speed} miles per hour for {hours} hours, then drives {extra} more miles. "
            f"How many miles does {name} drive in total?")


def _work(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    rate, days, week = rng.randint(8, 25), rng.randint(3, 6), rng.randint(2, 5)
    return (f"{name} earns ${rate} per hour and works 6 hours a day, {days} days a week. How much does {name} "
            f"earn in {week} weeks?")


def _percent(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    price, off = rng.randint(20, 90), rng.choice((10, 15, 20, 25, 30))
    return (f"A box of {item} costs ${price}. During a sale it is {off}% off. {name} buys 3 boxes. "
            f"How much does {name} pay?")


TEMPLATES = (_shop, _share, _rate, _work, _percent)


def math_prompts(count: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [TEMPLATES[i % len(TEMPLATES)](rng) + SUFFIX for i in range(count)]
