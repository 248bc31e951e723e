"""Checkpoints: tiered, verified training states under one folder. Imports no model code.

- store.py: `CheckpointStore`, the facade callers use (save, load, verify, retain, offload);
- layout.py: file and folder names, temporary folders, fsync, landing a folder in place;
- manifest.py: the vocabulary: manifest.json, formats, tensor records, state.json, keys;
- tiers.py: hot and cold experts, and each tier's codec, level and full-write interval;
- codec.py: tensor codecs (byte-grouped zstd/lzma, XOR deltas, fp16);
- tensors.py: a training state as flat tensor dicts (model, optimizer), weights digest;
- whole.py: writing a whole (one-process, format 2) checkpoint, deltas included;
- writer.py: the background writer thread;
- sharded.py: sharded (DCP, format 3) saves and restores;
- read.py: reading tensors back (a record, a whole checkpoint, a sharded one assembled);
- integrity.py: verify, the newest valid checkpoint, the listing `checkpoint ls` prints;
- retention.py: which checkpoints stay after a save;
- offload.py: checkpoint files in an object store (what may go, where, fetching back).
"""
