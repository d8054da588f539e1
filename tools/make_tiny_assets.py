#!/usr/bin/env python
"""Build the small model and dataset that ship inside leantune (src/leantune/assets/).

`leantune train` with no --model and no --data fine-tunes this model on this dataset, so the
first run works offline on a laptop CPU in a minute or two and shows the eval loss falling.

What it writes (everything is generated here from a seed; nothing is downloaded):
  tiny-llama/           a Hugging Face Llama checkpoint (config.json, model.safetensors bf16,
                        generation_config.json) plus a byte-level BPE tokenizer trained here
                        (tokenizer.json, tokenizer_config.json with a chat template,
                        special_tokens_map.json, chat_template.jinja)
  data/tiny_sft.jsonl   alpaca rows (instruction, input, output): a family of small synthetic
  data/tiny_sft_eval.jsonl  instruction tasks (capitals, opposites, addition, sorting, ...)

How the model is made: the tokenizer and the model are trained on generated English-like
"pretraining" text that contains the facts the tasks need (capitals, opposites, animal sounds,
plurals, sums, the alphabet) written as plain prose, plus word lists repeated, reversed and
sorted in prose (so the model learns to copy), but never the alpaca or chat format nor the task
questions. Fine-tuning on the SFT rows then teaches the format and the
question -> answer mapping, so the eval loss drops quickly.

Usage (from the repository root; about 6-7 minutes on 2 CPU cores, almost all pretraining):
    python tools/make_tiny_assets.py                 # writes src/leantune/assets
    python tools/make_tiny_assets.py --out /tmp/a --pretrain-steps 100   # quick try

Reproducible: the text, the rows and the tokenizer are byte-identical for a given --seed; the
weights are identical for a given seed, thread count and torch build (CPU float math may differ
across machines in the last bits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "src" / "leantune" / "assets"

# --------------------------------------------------------------------------------------------
# The little world the text and the tasks talk about
# --------------------------------------------------------------------------------------------

CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin",
    "Portugal": "Lisbon", "Greece": "Athens", "Egypt": "Cairo", "Japan": "Tokyo",
    "China": "Beijing", "India": "Delhi", "Russia": "Moscow", "Canada": "Ottawa",
    "Mexico": "Mexico City", "Peru": "Lima", "Chile": "Santiago", "Cuba": "Havana",
    "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin", "Turkey": "Ankara",
    "Iran": "Tehran", "Iraq": "Baghdad", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Argentina": "Buenos Aires", "Colombia": "Bogota", "Hungary": "Budapest",
    "Denmark": "Copenhagen", "Belgium": "Brussels", "Nepal": "Kathmandu", "Ghana": "Accra",
    "Morocco": "Rabat", "Australia": "Canberra", "Brazil": "Brasilia", "Scotland": "Edinburgh",
    "Wales": "Cardiff",
}

OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark",
    "up": "down", "open": "closed", "full": "empty", "old": "new", "early": "late",
    "high": "low", "long": "short", "hard": "soft", "wet": "dry", "rich": "poor",
    "strong": "weak", "loud": "quiet", "clean": "dirty", "heavy": "light", "thick": "thin",
    "near": "far", "inside": "outside", "day": "night", "win": "lose", "push": "pull",
    "buy": "sell", "give": "take", "first": "last", "true": "false", "left": "right",
    "begin": "end", "above": "below", "always": "never", "easy": "difficult",
    "cheap": "expensive", "young": "old", "sweet": "sour", "wide": "narrow",
}

SOUNDS = {
    "cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa",
    "pig": "oink", "horse": "neigh", "lion": "roar", "owl": "hoot", "frog": "croak",
    "bee": "buzz", "snake": "hiss", "mouse": "squeak", "rooster": "cock-a-doodle-doo",
    "goat": "bleat", "wolf": "howl", "crow": "caw", "donkey": "hee-haw",
}

PLURALS = {
    "cat": "cats", "dog": "dogs", "box": "boxes", "child": "children", "mouse": "mice",
    "tooth": "teeth", "foot": "feet", "man": "men", "woman": "women", "city": "cities",
    "baby": "babies", "leaf": "leaves", "knife": "knives", "wolf": "wolves", "bus": "buses",
    "dish": "dishes", "church": "churches", "tree": "trees", "book": "books", "apple": "apples",
    "sheep": "sheep", "fish": "fish", "goose": "geese", "person": "people", "story": "stories",
    "glass": "glasses", "horse": "horses", "party": "parties", "wife": "wives", "toy": "toys",
    "key": "keys", "potato": "potatoes", "hero": "heroes", "bird": "birds", "river": "rivers",
    "house": "houses", "ox": "oxen", "lady": "ladies", "fox": "foxes", "class": "classes",
}

NAMES = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Ida", "Jack",
         "Kira", "Leo", "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Umar", "Vera",
         "Will", "Yara", "Zoe"]
ADJS = ["red", "blue", "green", "little", "big", "old", "young", "quiet", "happy", "brown",
        "white", "black", "small", "tall", "clever", "lazy", "brave", "shy", "kind", "busy"]
ANIMALS = list(SOUNDS) + ["bird", "fox", "rabbit", "bear", "deer", "turtle"]
PLACES = ["river", "forest", "garden", "market", "house", "school", "bridge", "hill", "field",
          "lake", "road", "village", "park", "kitchen", "library", "station", "beach", "farm"]
VERBS_PAST = ["walked", "ran", "slept", "sat", "played", "waited", "jumped", "sang", "looked",
              "rested", "danced", "worked", "read", "ate", "swam", "stood"]
PREPS = ["near", "by", "in", "behind", "under", "across", "beside", "inside", "over"]
THINGS = ["apple", "book", "cup", "ball", "hat", "key", "box", "lamp", "chair", "coat", "bag",
          "pen", "shoe", "clock", "kite", "spoon", "plate", "boat", "bell", "map"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black",
          "white", "grey"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = sorted(set(ADJS + ANIMALS + PLACES + THINGS + COLORS + list(OPPOSITES)))
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]


# --------------------------------------------------------------------------------------------
# Pretraining text: English-like prose that states the facts, never in the chat format
# --------------------------------------------------------------------------------------------

def _words(rng: random.Random, lo: int, hi: int) -> list[str]:
    return rng.sample(WORDS, rng.randint(lo, hi))


def _s_capital(rng, n1, n2):
    c = rng.choice(list(CAPITALS))
    cap = CAPITALS[c]
    return rng.choice([
        f"{cap} is the capital of {c}.",
        f"The capital of {c} is {cap}.",
        f"{n1} lives in {cap}, the capital of {c}.",
        f"{n1} took a train to {cap}, the biggest city in {c}.",
        f"In {c}, the capital city is {cap}.",
        f"{n1} visited {c} and saw {cap}.",
    ])


def _s_opposite(rng, n1, n2):
    a = rng.choice(list(OPPOSITES))
    b = OPPOSITES[a]
    return rng.choice([
        f"The opposite of {a} is {b}.",
        f"{a.capitalize()} and {b} are opposites.",
        f"It was not {a}; it was {b}.",
        f"{n1} said {a}, and {n2} said {b}.",
    ])


def _s_sound(rng, n1, n2):
    an = rng.choice(list(SOUNDS))
    s = SOUNDS[an]
    return rng.choice([
        f"A {an} says {s}.",
        f"The {an} made a loud {s}.",
        f"{n1} heard a {an} go {s}.",
        f"Every morning the {an} says {s} {s}.",
    ])


def _s_plural(rng, n1, n2):
    sg = rng.choice(list(PLURALS))
    pl = PLURALS[sg]
    n = rng.randint(2, 12)
    return rng.choice([
        f"One {sg}, two {pl}.",
        f"{n1} has one {sg} and {n2} has {NUMBER_WORDS[n]} {pl}.",
        f"There was a {sg}, and then there were many {pl}.",
        f"{n1} counted {n} {pl}.",
    ])


def _s_number(rng, n1, n2):
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    c = rng.randint(0, 199)
    x, y = rng.sample(range(1, 100), 2)
    return rng.choice([
        f"{a} plus {b} is {a + b}.",
        f"{a} + {b} = {a + b}.",
        f"{n1} had {a} {rng.choice(THINGS)}s and got {b} more, so now {n1} has {a + b}.",
        f"After {c} comes {c + 1}.",
        f"{c}, {c + 1}, {c + 2}, {c + 3}.",
        f"{max(x, y)} is bigger than {min(x, y)}.",
        f"Of {x} and {y}, the larger is {max(x, y)}.",
    ])


def _s_letters(rng, n1, n2):
    i = rng.randint(0, 20)
    seq = " ".join(LETTERS[i:i + rng.randint(3, 6)])
    ls = rng.sample(LETTERS, rng.randint(3, 4))
    return rng.choice([
        f"The letters go {seq}.",
        f"In the alphabet, {LETTERS[i]} comes before {LETTERS[i + 1]}.",
        f"{n1} wrote {seq} on the board.",
        f"{n1} had the cards {' '.join(ls)} and put them in order: {' '.join(sorted(ls))}.",
    ])


def _s_words(rng, n1, n2):
    w = _words(rng, 1, 5)
    j = " ".join(w)
    return rng.choice([
        f"{n1} wrote:\n{j}\n{n2} wrote it again:\n{j}",
        f"The list:\n{j}\nThe same list backwards:\n{' '.join(reversed(w))}",
        f"{n1} made a list:\n{j}\nIt had {len(w)} words.",
        f"The sign said {j.upper()} in big letters.",
        f"{j} in capital letters is {j.upper()}.",
        f"{n1} said {j}, and {n2} said {j} too.",
        f"{n1} read {j} from the end: {' '.join(reversed(w))}.",
        f"{n1} wrote {NUMBER_WORDS[len(w)]} words: {j}.",
        f"The list was {j}; it started with {w[0]} and ended with {w[-1]}.",
    ])


def _s_dialogue(rng, n1, n2):
    c = rng.choice(list(CAPITALS))
    an = rng.choice(list(SOUNDS))
    a = rng.choice(list(OPPOSITES))
    sg = rng.choice(list(PLURALS))
    x, y = rng.randint(0, 20), rng.randint(0, 20)
    return rng.choice([
        f"{n1} asked {n2} about {c}. {n2} said the capital of {c} is {CAPITALS[c]}.",
        f"{n1} asked what a {an} says. {n2} said a {an} says {SOUNDS[an]}.",
        f"{n1} asked for the opposite of {a}.\n{n2} said:\n{OPPOSITES[a]}",
        f"{n1} asked for more than one {sg}.\n{n2} said:\n{PLURALS[sg]}",
        f"{n1} asked how much {x} and {y} make.\n{n2} said:\n{x + y}",
    ])


def _s_story(rng, n1, n2):
    adj, an, pl = rng.choice(ADJS), rng.choice(ANIMALS), rng.choice(PLACES)
    return rng.choice([
        f"The {adj} {an} {rng.choice(VERBS_PAST)} {rng.choice(PREPS)} the {pl}.",
        f"{n1} and {n2} {rng.choice(VERBS_PAST)} {rng.choice(PREPS)} the {pl}.",
        f"{n1} found a {rng.choice(COLORS)} {rng.choice(THINGS)} in the {pl}.",
        f"{n1} gave {n2} a {rng.choice(ADJS)} {rng.choice(THINGS)}.",
        f"One day, a {adj} {an} came to the {pl}.",
        f"{n1} likes the {rng.choice(COLORS)} {rng.choice(THINGS)} best.",
        f"It was a {rng.choice(['sunny', 'rainy', 'cold', 'warm', 'windy'])} day at the {pl}.",
        f"{n1} asked {n2} where the {rng.choice(THINGS)} was.",
    ])


SENTENCE_KINDS = [(_s_capital, 3), (_s_opposite, 2), (_s_sound, 1), (_s_plural, 2),
                  (_s_number, 3), (_s_letters, 2), (_s_words, 12), (_s_dialogue, 3),
                  (_s_story, 3)]


def _sentence(rng: random.Random) -> str:
    kinds, weights = zip(*SENTENCE_KINDS)
    n1, n2 = rng.sample(NAMES, 2)
    return rng.choices(kinds, weights)[0](rng, n1, n2)


def make_pretrain_docs(rng: random.Random, n_docs: int) -> list[str]:
    """Documents of 3-9 sentences, some on separate lines (so words are also seen at the start
    of a line, without the leading space, as they appear in the SFT inputs and answers)."""
    docs = []
    for _ in range(n_docs):
        parts = [_sentence(rng) for _ in range(rng.randint(3, 9))]
        doc = parts[0]
        for p in parts[1:]:
            doc += ("\n" if rng.random() < 0.35 else " ") + p
        docs.append(doc)
    return docs


# --------------------------------------------------------------------------------------------
# The SFT task family (alpaca rows)
# --------------------------------------------------------------------------------------------

# Lookup tasks (capitals, opposites, sounds, plurals) draw from a table. A few entries of each
# table are held out of the training rows: eval questions about them can only be answered with
# what the model read during pretraining, which the fine-tune teaches it to retrieve.
HELDOUT_FRACTION = 0.2


def _split_tables(seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    train, full = {}, {}
    for name, table in (("capitals", CAPITALS), ("opposites", OPPOSITES), ("sounds", SOUNDS),
                        ("plurals", PLURALS)):
        keys = sorted(table)
        held = set(rng.sample(keys, max(1, round(len(keys) * HELDOUT_FRACTION))))
        train[name] = [k for k in keys if k not in held]
        full[name] = keys
    return train, full


def _t_capital(rng, pool):
    c = rng.choice(pool["capitals"])
    q = rng.choice(["What is the capital of {c}?", "Name the capital city of {c}.",
                    "Which city is the capital of {c}?"]).format(c=c)
    return q, "", f"The capital of {c} is {CAPITALS[c]}."


def _t_opposite(rng, pool):
    a = rng.choice(pool["opposites"])
    return rng.choice(["Give the opposite of the word.", "Write the opposite of this word."]), \
        a, OPPOSITES[a]


def _t_sound(rng, pool):
    an = rng.choice(pool["sounds"])
    q = rng.choice(["What sound does a {a} make?", "What does a {a} say?"]).format(a=an)
    return q, "", f"A {an} says {SOUNDS[an]}."


def _t_plural(rng, pool):
    sg = rng.choice(pool["plurals"])
    return rng.choice(["Write the plural of the word.", "What is the plural form?"]), sg, \
        PLURALS[sg]


def _t_add(rng, pool):
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return rng.choice(["Add the two numbers.", "What is the sum?"]), f"{a} + {b}", str(a + b)


def _t_next(rng, pool):
    a = rng.randint(0, 199)
    return f"What number comes after {a}?", "", str(a + 1)


def _t_max(rng, pool):
    xs = rng.sample(range(1, 100), 2)
    return "Which number is larger?", " or ".join(map(str, xs)), str(max(xs))


def _t_sort(rng, pool):
    ls = rng.sample(LETTERS, rng.randint(3, 4))
    return "Sort the letters in alphabetical order.", " ".join(ls), " ".join(sorted(ls))


def _t_reverse(rng, pool):
    ws = rng.sample(WORDS, rng.randint(3, 4))
    return "Reverse the order of the words.", " ".join(ws), " ".join(reversed(ws))


def _t_repeat(rng, pool):
    ws = _words(rng, 2, 5)
    return "Repeat the words.", " ".join(ws), " ".join(ws)


def _t_count(rng, pool):
    ws = _words(rng, 1, 5)
    return "How many words are there?", " ".join(ws), str(len(ws))


def _t_first(rng, pool):
    ws = rng.sample(WORDS, rng.randint(3, 5))
    which = rng.choice(["first", "last"])
    return f"What is the {which} word?", " ".join(ws), ws[0] if which == "first" else ws[-1]


TASKS = [_t_capital, _t_opposite, _t_sound, _t_plural, _t_add, _t_next, _t_max, _t_sort,
         _t_reverse, _t_repeat, _t_count, _t_first]


def make_sft_rows(rng: random.Random, n: int, pool: dict, exclude: set | None = None
                  ) -> list[dict]:
    """n rows, the tasks in equal shares. With `exclude` (the training questions), no row's
    (instruction, input) is in it: the eval set never overlaps training."""
    rows, seen = [], set(exclude or ())
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        for _ in range(1000):
            ins, inp, out = task(rng, pool)
            if exclude is None or (ins, inp) not in seen:
                break
        else:
            raise RuntimeError(f"{task.__name__}: no new eval question left")
        rows.append({"instruction": ins, "input": inp, "output": out})
    rng.shuffle(rows)
    return rows


def make_sft_splits(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """The training and eval rows for a seed (eval questions never occur in training)."""
    train_pool, full_pool = _split_tables(seed)
    train_rows = make_sft_rows(random.Random(seed), n_train, train_pool)
    eval_rows = make_sft_rows(random.Random(seed + 1), n_eval, full_pool,
                              exclude={(r["instruction"], r["input"]) for r in train_rows})
    return train_rows, eval_rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL = [PAD, BOS, EOS] + ROLE_TOKENS  # ids 0..5

# One turn per message: <|role|>\n content <|eos|>; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: a plain encode starts with BOS (the chat template writes BOS itself and is
    # tokenized without special tokens, so there is never a double BOS).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)],
    )
    return tok


def save_tokenizer(tok, out: Path, max_len: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS, model_max_length=max_len,
        padding_side="right", clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    # Make the folder readable by older and other loaders too: tokenizer_config.json carries
    # the chat template and the special tokens itself, and a special_tokens_map.json exists.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("extra_special_tokens", None)  # v5 spelling; v4 reads additional_special_tokens
    cfg.update({
        "additional_special_tokens": ROLE_TOKENS, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": PAD, "chat_template": CHAT_TEMPLATE, "model_max_length": max_len,
        "add_bos_token": True, "add_eos_token": False, "padding_side": "right",
    })
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": ROLE_TOKENS,
    }, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return hf


# --------------------------------------------------------------------------------------------
# Model: build and pretrain
# --------------------------------------------------------------------------------------------

def pretrain(tok, docs: list[str], args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=args.tie,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        initializer_range=0.02, use_cache=True,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float().to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    # One long token stream: <bos> doc <eos> <bos> doc <eos> ...; random windows of seq_len.
    ids: list[int] = []
    for enc in tok.encode_batch(docs):  # post-processor adds BOS
        ids.extend(enc.ids)
        ids.append(eos_id)
    stream = torch.tensor(ids, dtype=torch.long, device=args.device)
    n_val = args.seq_len * 64
    train_s, val_s = stream[:-n_val], stream[-n_val:]
    print(f"pretraining stream: {len(stream)} tokens", flush=True)
    val = val_s[: (len(val_s) // args.seq_len) * args.seq_len].view(-1, args.seq_len)

    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.pretrain_steps // 20)

    def lr_at(s):
        if s < warm:
            return args.lr * (s + 1) / warm
        p = (s - warm) / max(1, args.pretrain_steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def val_loss():
        model.eval()
        with torch.no_grad():
            out = model(input_ids=val, labels=val).loss.item()
        model.train()
        return out

    t0 = time.time()
    print(f"step 0 val loss {val_loss():.3f}", flush=True)
    model.train()
    for step in range(args.pretrain_steps):
        starts = torch.randint(0, len(train_s) - args.seq_len, (args.batch,), generator=g)
        x = torch.stack([train_s[s:s + args.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step + 1 == args.pretrain_steps:
            print(f"step {step + 1} loss {loss.item():.3f} val {val_loss():.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return model.cpu()


def save_model(model, out: Path, dtype: str) -> None:
    import torch
    from transformers import GenerationConfig

    model = model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, max_new_tokens=64, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes rope_parameters; add the v4 field too so older readers agree.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg["torch_dtype"] = cfg.get("dtype", "float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (fixed for "
                    "reproducibility)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="stored weight dtype (pretraining itself runs in fp32)")
    ap.add_argument("--max-len", type=int, default=1024, help="max_position_embeddings")
    ap.add_argument("--docs", type=int, default=30000, help="pretraining documents")
    ap.add_argument("--pretrain-steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--device", default="cpu", help="where to pretrain (the shipped assets are "
                    "built on the CPU)")
    ap.add_argument("--n-train", type=int, default=2400)
    ap.add_argument("--n-eval", type=int, default=160)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out: Path = args.out
    model_dir, data_dir = out / "tiny-llama", out / "data"
    t_start = time.time()

    # Data first (cheap, and the tokenizer sees the task words too).
    train_rows, eval_rows = make_sft_splits(args.seed, args.n_train, args.n_eval)
    docs = make_pretrain_docs(random.Random(args.seed + 2), args.docs)
    write_jsonl(data_dir / "tiny_sft.jsonl", train_rows)
    write_jsonl(data_dir / "tiny_sft_eval.jsonl", eval_rows)
    print(f"data: {len(train_rows)} train rows, {len(eval_rows)} eval rows, "
          f"{len(docs)} pretraining docs", flush=True)

    # the tokenizer also sees the rows the way `leantune train` renders alpaca prompts
    sft_text = [f"### Instruction:\n{r['instruction']}\n\n### Input:\n{r['input']}\n\n"
                f"### Response:\n{r['output']}" for r in train_rows]
    tok = train_tokenizer(docs + sft_text, args.vocab)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    save_tokenizer(tok, model_dir, args.max_len)
    print(f"tokenizer: vocab {tok.get_vocab_size()}", flush=True)

    model = pretrain(tok, docs, args)
    save_model(model, model_dir, args.dtype)
    for p in out.rglob("*"):  # plain package-data permissions (safetensors writes 0600)
        if p.is_file():
            p.chmod(0o644)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
