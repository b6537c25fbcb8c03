"""Save a store to a snapshot file, lose it, and bring it back (also into a new store).

Run: python examples/snapshot_restore.py
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

import shmkv


def main() -> None:
    rng = np.random.default_rng(0)
    name = f"snap{os.getpid()}"
    path = os.path.join(tempfile.mkdtemp(), "cache.shmkv")
    with shmkv.create(name, layers=3, kv_heads=2, head_dim=8, dtype="int8") as store:
        seq = store.create_sequence(capacity=64)
        seq.extend(rng.standard_normal((3, 40, 2, 8)), rng.standard_normal((3, 40, 2, 8)),
                   tokens=np.arange(40))
        before = seq.raw_keys(1)[0].copy()
        nbytes = store.save(path, progress=lambda done, total: None)
        print(f"saved {nbytes} bytes to {path}")
        seq.truncate(5)  # damage: drop most of it
        seq.release()
        store.restore(path)  # all or nothing: every checksum is verified first
        assert np.array_equal(store.sequence(seq.id).raw_keys(1)[0], before)
        print(f"restored sequence {seq.id}: {len(store.sequence(seq.id))} tokens, int8 codes identical")
    other = shmkv.load(path, name=f"copy{os.getpid()}")  # a new store with the snapshot's layout
    print(f"loaded into {other.name!r}: {[(s.id, s.length) for s in other.sequences()]}")
    other.close()
    os.unlink(path)


if __name__ == "__main__":
    main()
