"""The tracker counts live storages exactly: every figure below is computed by hand, to the byte.

Sizes: fp32 4 bytes an element, fp64 and int64 8. "T" is the tracker's "temporaries", "A" its "activations".
"""
import threading
import weakref

import pytest
import torch
import torch.nn as nn

from minipar import GPT, GPTConfig, memory
from minipar.model import cross_entropy
from minipar.tracker import SAMPLES, Tracker


def zeros(**known):
    """The expected {category: bytes} with everything 0 but what is given."""
    return {"activations": 0, "temporaries": 0, **known}


def series(tr, category="temporaries"):
    return [live[category] for _, _, live in tr.timeline]


def test_torch_keeps_one_python_storage_per_storage_for_its_life():
    """What the tracker's weak references rest on (PyTorch 2.13): the same UntypedStorage object every
    time, for the tensor and its views, and alive (weakly reachable) as long as any of them is."""
    t = torch.empty(10)
    view = t[2:]
    assert t.untyped_storage() is t.untyped_storage() is view.untyped_storage()
    died = []
    ref = weakref.ref(t.untyped_storage(), died.append)  # no Python reference to the storage is kept...
    assert ref() is t.untyped_storage() and not died       # ...yet it lives: the tensor keeps the object
    del t
    assert not died  # the view still holds the storage
    del view
    assert died == [ref] and ref() is None


def test_temporaries_of_known_sizes_come_and_go_and_the_peak_is_the_maximum():
    tr = Tracker()
    with tr:
        a = torch.empty(100)                        # 400
        b = torch.empty(50, dtype=torch.float64)    # 400      -> 800
        c = a + 1                                   # 400      -> 1200
        assert tr.current == zeros(temporaries=1200)
        del b                                       # -400     -> 800
        d = torch.cat([c, c])                       # 800      -> 1600, the peak
        del a, c                                    # -400 -400 -> 800
        e = d[:10] * 2                              # a view (nothing), 40 -> 840
        del d                                       # -800     -> 40
        f = torch.empty(0)                          # 0 bytes
        g = torch.tensor([1.0, 2.0, 3.0])           # built outside the dispatcher, handed to lift_fresh: 12
        assert tr.current == zeros(temporaries=52)
    assert tr.peak_total == zeros(temporaries=1600) and tr.peak_total_phase is None
    assert tr.peak == zeros()  # nothing but temporaries was ever alive
    assert tr.current == zeros(temporaries=52)  # the state at exit: e, f and g
    # every event is a sample while there are fewer than SAMPLES: entry, 10 changes, exit
    assert series(tr) == [0, 400, 800, 1200, 800, 1600, 1200, 800, 840, 40, 40, 52, 52]
    assert [event for event, _, _ in tr.timeline] == list(range(13))
    del e, f, g


def test_known_tensors_count_from_the_start_and_declare_moves_a_temporary():
    p, buf = torch.empty(10), torch.empty(4, dtype=torch.float64)
    tr = Tracker(known={"params": [p, None], "comm": [buf]})
    with tr:
        assert tr.current == zeros(params=40, comm=32)
        t = torch.empty(25)                         # T 100
        tr.declare("comm", t[5:])                   # a view: its storage, all 100 bytes, moves
        assert tr.current == zeros(params=40, comm=132)
        tr.declare("grads", torch.empty(3))         # born T 12, declared: a new category, then freed
        assert tr.current == zeros(params=40, comm=132, grads=0)
        del t
        assert tr.current == zeros(params=40, comm=32, grads=0)
        with pytest.raises(ValueError):
            tr.declare("activations", p)            # the tracker decides those two itself
    # the largest total held: params, comm with t, and the 12 grads bytes; the largest total of all is
    # the same number of bytes a moment earlier, when those 12 were still a temporary (a tie keeps the first)
    assert tr.peak == zeros(params=40, comm=132, grads=12)
    assert tr.peak_total == zeros(params=40, comm=132, grads=0, temporaries=12)
    with pytest.raises(RuntimeError):
        tr.declare("comm", p)                       # outside the region


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 16, bias=False), nn.ReLU(),
                         nn.Linear(16, 4, bias=False))


def test_activations_of_an_mlp_are_what_autograd_saves_and_leave_after_backward():
    """Batch 5. Saved for backward: the input x (the first matmul's, for W1's gradient: 5x8), each ReLU's
    output (5x16; the next matmul saves the same storage), and each W.t() (a view of a parameter: stays
    "params"). Not saved: the Linear outputs before the ReLUs (freed once the ReLU ran), the last output."""
    model = mlp()
    params = list(model.parameters())  # 16x8 + 16x16 + 4x16 = 448 floats
    tr = Tracker(known={"params": params})
    with tr:
        with tr.phase("forward"):
            x = torch.randn(5, 8)
            out = model(x)
            loss = out.sum()
        assert tr.current == zeros(params=1792, activations=5 * 8 * 4 + 2 * 5 * 16 * 4,  # 160 + 640
                                   temporaries=5 * 4 * 4 + 4)                          # out, loss
        with tr.phase("backward"):
            loss.backward()
        # the graph is freed: no activations; x, out, loss and the three gradients (fp32, 448 floats) remain
        assert tr.current == zeros(params=1792, temporaries=160 + 80 + 4 + 1792)
    assert tr.peak["activations"] == 800 and tr.peak_phase == "forward"
    assert {live["params"] for _, _, live in tr.timeline} == {1792}
    in_forward = [live["activations"] for _, phase, live in tr.timeline if phase == "forward"]
    assert in_forward == sorted(in_forward) and in_forward[-1] == 800


def test_a_storage_resized_to_zero_and_back_counts_its_current_size():
    """ZeRO-3: a unit's full buffer lives at 0 bytes, is refilled by resize_ to gather (here on another
    thread, as zero.py's communication thread does) and freed by resize_(0) after use."""
    full, resize = torch.empty(64), torch.UntypedStorage.resize_
    full.untyped_storage().resize_(0)
    tr = Tracker(known={"comm": [full]})
    with tr:
        assert tr.current == zeros(comm=0)
        gather = threading.Thread(target=lambda: full.untyped_storage().resize_(256))
        gather.start()
        gather.join()
        assert tr.current == zeros(comm=256)
        full.fill_(1.0)
        y = full * 2                                 # T 256
        full.untyped_storage().resize_(0)            # the free
        assert tr.current == zeros(comm=0, temporaries=256)
        y.untyped_storage().resize_(40)              # a temporary resized too
        y.resize_(30)                                # Tensor.resize_ is an op: its output's size is re-read
        assert tr.current == zeros(comm=0, temporaries=120)
    assert tr.peak == zeros(comm=256) and tr.peak_total == zeros(comm=256, temporaries=256)
    assert torch.UntypedStorage.resize_ is resize and "resize_" not in vars(torch.UntypedStorage)  # unwrapped


def test_views_count_once_and_storages_from_before_the_region_are_ignored():
    w, z = torch.empty(4, 4), torch.empty(10)  # z: not known
    tr = Tracker(known={"params": [w, w.t(), w[0], w.view(-1)]})
    with tr:
        assert tr.current == zeros(params=64)
        views = [w.t(), w.view(16), w[1:], z.view(2, 5), z[3:]]
        z.add_(1)                                    # in place on a storage from before: not counted
        a = torch.empty(10)
        more = [a[2:], a.view(2, 5), a.unsqueeze(0), a.t()]
        b = w.t().contiguous()                       # a copy: new
        c = z + 1                                    # new
        assert tr.current == zeros(params=64, temporaries=40 + 64 + 40)
    del views, more, b, c


def test_only_the_entering_thread_is_watched_but_deaths_are_seen_on_any():
    tr = Tracker()
    with tr:
        box = [torch.empty(3)]                       # T 12
        for work in (lambda: box.append(torch.empty(100)),  # allocated on another thread: not seen
                     box.clear):                     # the last references die on another thread
            thread = threading.Thread(target=work)
            thread.start()
            thread.join()
        assert tr.current == zeros()
    assert tr.peak_total == zeros(temporaries=12)


def test_the_timeline_is_thinned_but_keeps_every_spike_and_the_phases():
    tr = Tracker()
    with tr:
        for i in range(3000):                        # 6000 events: a birth and a death each
            torch.empty(1)
            if i == 1234:
                with tr.phase("spike"):
                    torch.empty(1000)
        with tr.phase("end"):
            kept = torch.empty(2)
    timeline = tr.timeline
    assert len(timeline) <= SAMPLES + 10
    events = [e for e, _, _ in timeline]
    assert events == sorted(set(events)) and events[0] == 0
    assert max(live["temporaries"] for _, _, live in timeline) == 4000 == tr.peak_total["temporaries"]
    assert tr.peak_total_phase == "spike" and [p for _, p, _ in timeline].count("spike") >= 2
    # the last: entering "end", its allocation, leaving it, the exit
    assert [(p, live["temporaries"]) for _, p, live in timeline[-4:]] == [("end", 0), ("end", 8), (None, 8),
                                                                           (None, 8)]
    del kept


def test_a_gpt_step_params_grads_optimizer_exact_activations_rise_and_fall():
    """A whole step (forward, backward, AdamW) of a tiny GPT: the persistent states equal memory.tensor_bytes
    of their tensors; the activations at the peak equal memory.activations' count, which ActivationMeter
    measures too (x and y are made inside the region, so that they count, as memory.activations does)."""
    torch.manual_seed(0)
    cfg, b = GPTConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64, seq_len=16), 8
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())

    def step(tr):
        idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1))
        x, y = idx[:, :-1].clone(), idx[:, 1:].clone()
        with tr.phase("forward"):
            loss = cross_entropy(model(x), y)
        with tr.phase("backward"):
            loss.backward()
        with tr.phase("step"):
            optimizer.step()

    with Tracker() as warm_up:  # AdamW makes its state on the first step
        step(warm_up)
    optimizer.zero_grad(set_to_none=True)  # the gradients are born in backward, as in training
    tr = Tracker(known={"params": params, "optimizer": list(memory.optimizer_tensors(optimizer))})
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tr.declare("grads", p.grad)) for p in params]
    with tr:
        step(tr)
    for hook in hooks:
        hook.remove()

    p, g = memory.tensor_bytes(params), memory.tensor_bytes([q.grad for q in params])
    o = memory.tensor_bytes(memory.optimizer_tensors(optimizer))
    end = tr.current
    assert (end["params"], end["grads"], end["optimizer"], end["activations"]) == (p, g, o, 0)
    assert (p, g, o) == (4 * cfg.num_params, 4 * cfg.num_params, 8 * cfg.num_params + 4 * len(params))
    # the peak: at the end of forward, all activations held (more than the gradients, at this size)
    saved = sum(memory.activations(cfg, b).values())
    assert tr.peak_phase == "forward"
    assert (tr.peak["params"], tr.peak["optimizer"], tr.peak["grads"], tr.peak["activations"]) == (p, o, 0, saved)
    assert tr.cuda_max_allocated is None

    timeline = tr.timeline
    assert 10 < len(timeline) <= 2000
    totals = [sum(live.values()) for _, _, live in timeline]
    held = [t - live["temporaries"] for t, (_, _, live) in zip(totals, timeline)]
    assert max(totals) == sum(tr.peak_total.values()) and max(held) == sum(tr.peak.values()) - tr.peak["temporaries"]
    forward = [live["activations"] for _, phase, live in timeline if phase == "forward"]
    backward = [live["activations"] for _, phase, live in timeline if phase == "backward"]
    assert forward == sorted(forward) and forward[0] < forward[-1] == saved
    assert backward == sorted(backward, reverse=True) and backward[0] == saved and backward[-1] == 0
    grads = [live["grads"] for _, phase, live in timeline if phase == "backward"]
    assert grads == sorted(grads) and grads[-1] == g


def test_a_retained_graph_frees_its_activations_when_dropped_without_the_garbage_collector():
    """The saved alias is detached: had autograd been handed the saved output itself, that output and its
    node would make a reference cycle, and a retained graph (a pipeline's split backward) would outlive
    its last reference until a garbage collection."""
    model = mlp()
    tr = Tracker(known={"params": list(model.parameters())})
    with tr:
        x = torch.randn(5, 8)
        loss = model(x).sum()
        loss.backward(retain_graph=True)
        assert tr.current["activations"] == 800
        del loss                                     # the graph's last reference
        assert tr.current["activations"] == 0
