"""hdp's first ``--init-from`` step against transformers': the loss and every gradient, for each
architecture of ``tests/hf_models.py`` on 1, 2 and 4 gloo ranks, with the relative errors the
tests bound (1e-5 for the loss, 1e-4 for each gradient) printed as measured.

    python scripts/hf_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_hf_models as cases  # noqa: E402
from distributed import run_ranks  # noqa: E402
from hf_models import KINDS, hf_name_of, reference, write_checkpoints, write_corpus  # noqa: E402


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
        run_ranks(
            cases._train_kinds, world, dirs, root / "corpus.jsonl", cases.CAPACITY[world], str(out)
        )
        results = torch.load(out)
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
