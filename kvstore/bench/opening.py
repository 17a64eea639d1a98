"""Opening a store: ``KVStore(path, model, tokenizer)`` in fresh child processes, the
model already loaded (not timed), for a model the store has seen before and for one
it has not (a new store), alternating."""

import os
import shutil
from typing import Dict

from tqdm import tqdm

from kvstore import KVStore
from kvstore.bench import child

LABELS = {"known": "model seen before", "new": "model never seen (new store)"}


def bench_open(model, tokenizer, *, model_name, repeats: int, tmp: str) -> Dict:
    """Every child's open time (and CPU) for the known and the new model."""
    known = os.path.join(tmp, "open-known")
    KVStore(known, model, tokenizer, ram_bytes=0).close()  # the model is now seen
    cases = {name: {"label": label, "samples": []} for name, label in LABELS.items()}
    names = list(cases)
    for r in tqdm(range(repeats), desc="store open", leave=False):
        for name in names[r % 2 :] + names[: r % 2]:
            path = known if name == "known" else os.path.join(tmp, f"open-new-{r}")
            spec = {"case": "open", "model": model_name, "store": path}
            cases[name]["samples"].append(child.spawn(spec, tmp))
            if name == "new":
                shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(known, ignore_errors=True)
    return {"model": model_name, "cases": cases}
