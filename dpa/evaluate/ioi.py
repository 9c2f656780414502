"""Indirect object identification prompts from templates, with the contrast name.

Each prompt introduces two people, then repeats one of them (the subject S) as the giver; the
answer is the other (the indirect object IO), and S is the natural contrast token. Half of the
prompts name IO first (ABBA), half name S first (BABA).
"""

from __future__ import annotations

import random

from ..checks import check_int

TEMPLATES = (
    "When {A} and {B} went to the {place}, {S} gave a {thing} to",
    "After {A} and {B} went to the {place}, {S} gave a {thing} to",
    "While {A} and {B} were working at the {place}, {S} gave a {thing} to",
    "When {A} and {B} got a {thing} at the {place}, {S} decided to give it to",
    "{A} and {B} found a {thing} at the {place}. {S} gave it to",
    "Then, {A} and {B} were thinking about going to the {place}. {S} wanted to give a {thing} to",
    "Friends {A} and {B} went to the {place}. {S} handed a {thing} to",
)
NAMES = (
    "Mary", "John", "Tom", "James", "Anna", "Sarah", "Michael", "David", "Emma", "Lisa", "Paul", "Kate",
    "Mark", "Laura", "Peter", "Linda", "Daniel", "Susan", "Robert", "Alice", "George", "Helen", "Frank",
    "Rachel", "Steven", "Julia", "Henry", "Emily", "Jack", "Grace",
)
PLACES = ("store", "park", "school", "office", "garden", "restaurant", "market", "beach", "station", "library")
THINGS = ("drink", "book", "ring", "kiss", "bone", "basketball", "computer", "necklace", "snack", "letter")


def generate_ioi(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` records like ``ioi.json``'s (case_id, prompt, answer) plus ``contrast`` (S) and ``order``."""
    n = check_int("n", n, low=0)
    rng = random.Random(check_int("seed", seed))
    records = []
    for i in range(n):
        io, s = rng.sample(NAMES, 2)
        order = "ABBA" if i % 2 == 0 else "BABA"
        a, b = (io, s) if order == "ABBA" else (s, io)
        prompt = rng.choice(TEMPLATES).format(A=a, B=b, S=s, place=rng.choice(PLACES), thing=rng.choice(THINGS))
        records.append({"case_id": i, "prompt": prompt, "answer": io, "contrast": s, "order": order})
    return records
