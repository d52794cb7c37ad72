"""The models and the lm-eval task of ``examples/evolve.yml``, made here, offline, in seconds.

    python examples/evolve/make_models.py
    hubsoup evolve examples/evolve.yml --out ./evolved

Writes, beside this file: ``models/base`` (a tiny Llama with a word-level tokenizer), ``models/ft-a`` and
``models/ft-b`` (two "fine-tunes" of it: the base plus seeded noise, as ``hubsoup.testing`` makes them for the
tests) and ``tasks/choices.yaml``, a custom lm-evaluation-harness task (multiple choice, accuracy) over
``choices.jsonl``, the small data file shipped here. lm-eval reads a task's ``data_files`` relative to the working
folder, so the YAML written here names that file by its absolute path: the example then runs from any folder.
Running it again rebuilds the same models (fixed seeds). Swap in real models by editing ``examples/evolve.yml``.
"""

from __future__ import annotations

import argparse
import os
import shutil

from hubsoup.testing import choice_task_yaml, make_base, make_finetune, save_tiny_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The tiny models and the lm-eval task of examples/evolve.yml.")
    parser.add_argument("--into", default=HERE, help="where models/ and tasks/ go (default: beside this script, "
                                                     "where examples/evolve.yml looks)")
    args = parser.parse_args(argv)
    models, tasks = os.path.join(args.into, "models"), os.path.join(args.into, "tasks")
    for folder in (models, tasks):
        shutil.rmtree(folder, ignore_errors=True)
    base = make_base("llama", os.path.join(models, "base"), layers=4)
    save_tiny_tokenizer(base)
    for name, seed in (("ft-a", 1), ("ft-b", 2)):
        save_tiny_tokenizer(make_finetune(base, os.path.join(models, name), seed=seed, scale=0.05))
    os.makedirs(tasks)
    with open(os.path.join(tasks, "choices.yaml"), "w", encoding="utf-8") as f:
        f.write("# written by make_models.py: a custom lm-eval task (lm-eval's own YAML format) over choices.jsonl\n"
                + choice_task_yaml("toy_choices", os.path.join(HERE, "choices.jsonl")))
    print(f"models: {', '.join(sorted(os.listdir(models)))} in {models}")
    print(f"lm-eval task: toy_choices in {tasks} (over {os.path.join(HERE, 'choices.jsonl')})")
    print("next: hubsoup evolve examples/evolve.yml --out ./evolved")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
