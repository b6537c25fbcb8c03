"""Save a store to a snapshot file, damage it, restore it, and load it into a new store.

Run: python examples/snapshot_restore.py
"""

from __future__ import annotations

from _cli import run, temporary_directory  # first, before numpy and shmkv: --help, Ctrl-C (not about shmkv)

import os

import numpy as np

import shmkv


def main() -> None:
    rng = np.random.default_rng(0)
    name = f"snap{os.getpid()}"
    with temporary_directory("shmkv-example-") as tmp:  # removed on the way out, Ctrl-C or not
        path = os.path.join(tmp, "cache.shmkv")
        with shmkv.create(name, layers=3, kv_heads=2, head_dim=8, dtype="int8") as store:
            seq = store.create_sequence(capacity=64)
            seq.extend(rng.standard_normal((3, 40, 2, 8)), rng.standard_normal((3, 40, 2, 8)),
                       tokens=np.arange(40))
            before = seq.raw_keys(1)[0].copy()
            nbytes = store.save(path)
            print(f"saved {nbytes} bytes to a snapshot file")
            seq.truncate(5)  # damage: drop most of it
            seq.release()
            store.restore(path)  # all or nothing: every checksum is verified first
            assert np.array_equal(store.sequence(seq.id).raw_keys(1)[0], before)
            print(f"restored sequence {seq.id}: {len(store.sequence(seq.id))} tokens, int8 codes identical")
        with shmkv.load(path, name=f"copy{os.getpid()}") as other:  # a new store, the snapshot's layout
            print(f"loaded into a new store: {[(s.id, s.length) for s in other.sequences()]}")
    print("the snapshot's directory and both stores are gone")


if __name__ == "__main__":
    run(main, __doc__)
