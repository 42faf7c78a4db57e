"""Bytes of one recurrent-state checkpoint vs the K/V of a chunk, for a hybrid model's config.

    python bench/checkpoint_bytes.py path/to/config.json [--chunk-size 256] [--kv-bytes 2]

Understands gated-delta hybrids (Qwen3.5, Qwen3-Next: `linear_*` keys, `full_attention_interval`).
With no argument it uses Qwen3.5-9B's published values.
"""

from __future__ import annotations

import argparse
import json

QWEN3_5_9B = {
    "num_hidden_layers": 32, "full_attention_interval": 4, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_key_value_heads": 4, "head_dim": 256,
}


def figures(cfg: dict, chunk_size: int, kv_bytes: int) -> dict:
    cfg = cfg.get("text_config", cfg)
    layers, every = cfg["num_hidden_layers"], cfg.get("full_attention_interval", 4)
    full = layers // every
    linear = layers - full
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    recurrent = hv * dv * dk * 4  # float32 state, as mlx-lm's gated delta keeps it
    conv = (cfg["linear_conv_kernel_dim"] - 1) * (2 * hk * dk + hv * dv) * kv_bytes
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = full * 2 * cfg["num_key_value_heads"] * head_dim * kv_bytes
    checkpoint = linear * (recurrent + conv)
    return {
        "linear_layers": linear,
        "full_attention_layers": full,
        "checkpoint_bytes": checkpoint,
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_per_chunk": kv_per_token * chunk_size,
        "checkpoint_over_chunk_kv": checkpoint / (kv_per_token * chunk_size),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a model's config.json (default: Qwen3.5-9B's values)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--kv-bytes", type=int, default=2, help="bytes per K/V element (bf16: 2)")
    args = ap.parse_args()
    if args.chunk_size < 1 or args.kv_bytes < 1:
        ap.error("--chunk-size and --kv-bytes must be at least 1")
    cfg = QWEN3_5_9B
    if args.config:
        try:
            with open(args.config) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"cannot read {args.config} as a model's config.json: {e}")
    try:
        rows = figures(cfg, args.chunk_size, args.kv_bytes)
    except KeyError as e:
        ap.error(f"{args.config} has no {e} (not a gated-delta hybrid's config: Qwen3.5 or Qwen3-Next)")
    for k, v in rows.items():
        print(f"{k:28} {v:,.2f}" if isinstance(v, float) else f"{k:28} {v:,}")


if __name__ == "__main__":
    main()
