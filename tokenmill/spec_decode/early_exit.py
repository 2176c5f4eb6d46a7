"""An early-exit draft checkpoint: a GGUF's first decoder layers as a GGUF of their own.

Self-speculation by early exit (LayerSkip, Elhoushi et al., arXiv 2404.16710,
§4): the draft is the target's first ``layers`` blocks followed by the
target's own final norm and LM head, so it shares the tokenizer and needs no
other checkpoint. LayerSkip trains the model so that early exits predict well;
applied to a model trained without it (as here), the exit's acceptance rate is
low. The copy keeps every tensor byte for byte in its block format (Q4_1,
Q8_0...), so the draft runs on the same low-bit kernels as the target.
"""

from __future__ import annotations

from pathlib import Path


def truncate_gguf(src: str, layers: int, out: str | Path) -> str:
    """Write ``out``: ``src`` with blocks ``0 .. layers - 1`` only and ``{arch}.block_count = layers``.

    Args:
        src: a GGUF file.
        layers: decoder blocks to keep (1 .. the source's block count).
        out: the new file's path (its folder is created).

    Returns:
        ``str(out)``.

    Raises:
        ValueError: ``layers`` outside ``1 .. block_count``.
    """
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    total = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in 1..{total}, got {layers}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, layers if key == f"{arch}.block_count" else field.contents(), vtype, sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)
