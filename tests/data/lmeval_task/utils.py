"""Dataset loader for qwen4exp_tiny_mc.yaml: reads questions.jsonl next to this file."""

import json
import os

import datasets


def load_questions(**kwargs) -> datasets.DatasetDict:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "questions.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
