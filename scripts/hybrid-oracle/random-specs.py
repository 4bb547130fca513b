"""Random case specs for hybrid.py (one per line), seeded: layer patterns of every model family
(counts that do not divide the group size included), TP pairs from 1 to 8, host buffers, stated
block sizes of window models, FlashInfer-aligned GDN and prompts from 1 token up.

  python3 random-specs.py SEED COUNT     (a spec that cannot describe a model is skipped)
"""
import random
import sys


def specs(seed, count):
    rng = random.Random(seed)
    tps = [1, 2, 4, 8]
    for i in range(count):
        m = rng.choice(["nemotronh", "qwen3next", "gptoss", "gemma3", "jamba", "falconh1", "granite"])
        p, d = rng.choice(tps), rng.choice(tps)
        kw = {}
        if m == "nemotronh":  # M: Mamba2, *: attention, -: MLP
            kw["pattern"] = "".join(rng.choice("MM*-") for _ in range(rng.randint(3, 12)))
            if "M" not in kw["pattern"] or "*" not in kw["pattern"]:
                continue
        elif m == "qwen3next":  # G: GDN, A: full attention
            kw["pattern"] = "".join(rng.choice("GGGA") for _ in range(rng.randint(3, 12)))
            if "G" not in kw["pattern"] or "A" not in kw["pattern"]:
                continue
            if rng.random() < 0.4:
                kw["gdn_align"] = 64
        elif m in ("gptoss", "gemma3"):  # S: sliding window, F: full
            kw["pattern"] = "".join(rng.choice("SSF") for _ in range(rng.randint(2, 12)))
            if "S" not in kw["pattern"]:
                continue
            if rng.random() < 0.3:
                kw["p_bs"] = rng.choice([16, 32, 64])
            if rng.random() < 0.3:
                kw["d_bs"] = rng.choice([16, 32, 64])
        elif m in ("jamba", "falconh1"):
            kw["n_layers"] = rng.randint(2, 12) if m == "jamba" else rng.randint(1, 6)
            if m == "jamba" and kw["n_layers"] < 5:  # Jamba's one attention layer is layer 4
                continue
        if rng.random() < 0.25:
            kw["hostbuf"] = 1
        if rng.random() < 0.7:
            kw["prompt"] = rng.choice([1, 15, 16, 17, 100, 300, 700, 1500, 2500, 5000])
        name = f"r{seed}_{i}_{m}_P{p}_D{d}"
        opts = ",".join(f"{k}={v}" for k, v in kw.items())
        yield f"{m}:{p}:{d}:{name}" + (f":{opts}" if opts else "")


if __name__ == "__main__":
    print("\n".join(specs(int(sys.argv[1]), int(sys.argv[2]))))
