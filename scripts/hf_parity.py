"""hdp's first ``--init-from`` step against transformers': the loss and every gradient, for each
architecture of :mod:`hdp.testing.hf_models` on 1, 2 and 4 gloo ranks, with the relative errors the
tests bound (1e-5 for the loss, 1e-4 for each gradient) printed as measured.

    python scripts/hf_parity.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from hdp.testing.hf_models import (
    CAPACITY,
    KINDS,
    first_steps,
    hf_name_of,
    reference,
    write_checkpoints,
    write_corpus,
)
from hdp.testing.ranks import run_ranks


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="hdp-parity-"))
    dirs = write_checkpoints(root)
    docs = write_corpus(root / "corpus.jsonl")
    refs = {kind: reference(d, docs, grads=True) for kind, d in dirs.items()}
    print(
        f"{'ranks':>5} {'model':<8} {'loss':>9} {'transformers':>12} {'loss err':>9} "
        f"{'max grad err':>12} {'doc over ranks':>14}"
    )
    for world in (1, 2, 4):
        out = root / f"ranks{world}.pt"
        run_ranks(first_steps, world, dirs, root / "corpus.jsonl", CAPACITY[world], str(out))
        results = torch.load(out, weights_only=True)
        for kind in KINDS:
            ref_loss, ref_grads = refs[kind]
            got = results[kind]
            loss_err = abs(got["loss"] - ref_loss) / abs(ref_loss)
            grad_err = max(
                float(
                    (g - ref_grads[hf_name_of(n)].float()).norm() / ref_grads[hf_name_of(n)].norm()
                )
                for n, g in got["grads"].items()
            )
            print(
                f"{world:>5} {kind:<8} {got['loss']:>9.6f} {ref_loss:>12.6f} {loss_err:>9.1e} "
                f"{grad_err:>12.1e} {got['split']:>14}"
            )


if __name__ == "__main__":
    main()
