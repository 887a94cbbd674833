"""Fast checks of the demo world, its tokenizer and the tiny CLIP config (no training)."""
from __future__ import annotations

import time

import pytest
import torch

from merger.demo import world
from merger.demo.model import CLIP_CONFIG, MEAN, STD, create_model, preprocess
from merger.demo.tokenizer import DemoTokenizer


def test_generate_is_deterministic_per_seed():
    a_img, a_lab = world.generate(64, seed=7)
    b_img, b_lab = world.generate(64, seed=7)
    c_img, c_lab = world.generate(64, seed=8)
    assert a_img.dtype == torch.uint8 and a_img.shape == (64, 3, 32, 32)
    assert torch.equal(a_img, b_img)
    assert all(torch.equal(a_lab[t], b_lab[t]) for t in world.TASKS)
    assert not torch.equal(a_img, c_img)
    assert any(not torch.equal(a_lab[t], c_lab[t]) for t in world.TASKS)


def test_a_domain_holds_its_attributes_and_keeps_the_rest_of_the_draw():
    free_img, free = world.generate(200, seed=5)
    img, held = world.generate(200, seed=5, fixed={"background": 2, "colour": 0})
    assert torch.equal(held["background"], torch.full((200,), 2)) and torch.equal(held["colour"], torch.zeros(200, dtype=torch.int64))
    assert all(torch.equal(held[t], free[t]) for t in world.TASKS if t not in ("background", "colour"))
    assert torch.equal(img, world.generate(200, seed=5, fixed={"background": 2, "colour": 0})[0])
    assert not torch.equal(img, free_img)
    # every task of the shipped world has a domain that leaves its own attribute free
    assert set(world.DOMAINS) == set(world.TASKS)
    assert all(t not in d and all(0 <= v < len(world.TASKS[a]) for a, v in d.items()) for t, d in world.DOMAINS.items())
    with pytest.raises(ValueError, match="fixed: size=7"):
        world.generate(4, seed=0, fixed={"size": 7})


def test_labels_match_class_counts_and_cover_all_classes():
    _, labels = world.generate(2000, seed=1)
    assert set(labels) == set(world.TASKS)
    assert len(world.TASKS) >= 6
    for task, classes in world.TASKS.items():
        y = labels[task]
        assert y.dtype == torch.int64 and y.shape == (2000,)
        assert int(y.min()) >= 0 and int(y.max()) < len(classes)
        assert len(torch.unique(y)) == len(classes), task  # every class occurs
        assert len(set(classes)) == len(classes)


def test_generation_is_fast():
    world.generate(100, seed=0)  # warm-up
    t0 = time.perf_counter()
    world.generate(6000, seed=0)
    assert time.perf_counter() - t0 < 6.0  # budget is 3 s; slack for loaded CI machines


def test_templates_have_a_slot():
    assert set(world.TEMPLATES) == set(world.TASKS)
    for templates in world.TEMPLATES.values():
        assert templates and all("{}" in t for t in templates)


def test_captions_mention_attribute_words():
    _, labels = world.generate(200, seed=3)
    caps = world.captions(labels, seed=0)
    assert len(caps) == 200 and all(isinstance(c, str) and c for c in caps)
    assert caps == world.captions(labels, seed=0)
    for i, cap in enumerate(caps):
        named = [world.TASKS[t][labels[t][i]] for t in world.TASKS]
        assert any(name in cap for name in named), cap
    # with every attribute kept, every class name appears in its image's caption
    full = world.captions(labels, seed=0, p=1.0)
    for i, cap in enumerate(full):
        for t in world.TASKS:
            assert world.TASKS[t][labels[t][i]] in cap, (t, cap)


def test_tokenizer_round_trip_and_special_ids():
    tok = DemoTokenizer()
    texts = ["a small red circle in the top left with white dots.", "a teal striped background."]
    ids = tok(texts)
    assert ids.dtype == torch.long and ids.shape == (2, tok.context_length)
    assert (ids[:, 0] == tok.sot_token_id).all()
    assert tok.eot_token_id == tok.vocab_size - 1 == int(ids.max())
    assert (ids.argmax(dim=-1) == (ids != 0).sum(-1) - 1).all()  # EOT is the last non-pad token
    assert tok.decode(ids[0].tolist()) == texts[0].rstrip(".")
    assert ids[1, (ids[1] != 0).sum():].eq(0).all()  # zero padding
    # every word of every caption and template is in the vocabulary (no unknown ids)
    _, labels = world.generate(100, seed=0)
    words = world.captions(labels, seed=0, p=1.0)
    words += [t.format(c) for task, ts in world.TEMPLATES.items() for t in ts for c in world.TASKS[task]]
    assert all(tok.UNK not in tok.encode(w) for w in words)
    assert DemoTokenizer().words == tok.words  # deterministic vocabulary


def test_model_config_builds_with_open_clip():
    tok = DemoTokenizer()
    assert CLIP_CONFIG["text_cfg"]["vocab_size"] == tok.vocab_size
    assert CLIP_CONFIG["text_cfg"]["context_length"] == tok.context_length
    model = create_model(seed=0)
    img, _ = world.generate(4, seed=0)
    x = preprocess(img)
    assert x.dtype == torch.float32 and x.shape == (4, 3, 32, 32)
    assert len(MEAN) == len(STD) == 3
    with torch.inference_mode():
        f = model.encode_image(x)
        t = model.encode_text(tok(["a red circle.", "a blue square."]))
    assert f.shape == (4, CLIP_CONFIG["embed_dim"]) and t.shape == (2, CLIP_CONFIG["embed_dim"])
    # same seed, same weights
    a, b = create_model(seed=0).state_dict(), create_model(seed=0).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
