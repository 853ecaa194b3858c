"""The decode engine on a tiny randomly initialised llama built here (no download)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from adapters.engine.choose import pick, working_formats
from adapters.engine.engine import Engine, logprob_records, sample_rows
from adapters.engine.families import UnsupportedModel
from adapters.engine.grammar import forbidden_penalty
from adapters.engine.layers.attention import row_groups
from adapters.engine.model import LoadedModel
from adapters.engine.runner import Runner
from adapters.engine.sampling import TokenDraw
from adapters.engine.thread import EngineThread
from adapters.engine.weights import FORMATS, activation_dtype, projection
from core.batching import BatchLimits
from core.protocol import (
    Assignment,
    Cancel,
    Decoded,
    DecodeDone,
    DecoderFailed,
    Finished,
    FromRouterMessage,
    GenerationRequest,
    Offer,
    Sampling,
    SendToRouter,
    StartDecode,
    StopDecode,
    Token,
)
from core.worker import Worker, WorkerConfig
from tests.support.tiny_models import loaded_of

VOCAB = 97
PROMPTS = [(1, 2, 3, 4, 5, 6, 7), (9, 8), tuple(range(11, 30))]


def tiny_llama(vocab: int = VOCAB, positions: int = 128) -> LlamaForCausalLM:
    """A two-layer random llama (seed 0) for tests that need a real forward pass."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return tiny_llama()


def engine(model: LlamaForCausalLM, eos: frozenset[int] = frozenset(), **limits: int) -> Engine:
    settings = {"max_seqs": 4, "max_context": 128, "max_step_tokens": 16, "max_prefill_tokens": 5}
    loaded = LoadedModel.from_model(model, None, "tiny", eos, 128, "built in the test")
    return Engine(loaded, BatchLimits(**(settings | limits)))


def run(eng: Engine, requests: list[GenerationRequest]) -> dict[str, list[int | str]]:
    """Start every request at once and step until done: request id -> tokens, then reason."""
    for request in requests:
        eng.start(Assignment(request.request_id, 1), request)
    out: dict[str, list[int | str]] = {r.request_id: [] for r in requests}
    by_id = {r.request_id: r for r in requests}
    while eng.has_work():
        for event in eng.step():
            rid = event.assignment.request_id
            if isinstance(event, Decoded):
                prefix = len(by_id[rid].output_prefix)  # a continuation starts at index k
                assert event.index == prefix + sum(isinstance(t, int) for t in out[rid])
                out[rid].append(event.token_id)
            else:
                out[rid].append(event.reason)
    return out


def hf_greedy(model: LlamaForCausalLM, prompt: tuple[int, ...], tokens: int) -> list[int]:
    ids = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=tokens,
        eos_token_id=None,  # the tiny config's eos (2) must not stop HF early
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in ids[0, len(prompt) :]]


def test_greedy_batched_chunked_output_equals_hf_generate(tiny: LlamaForCausalLM) -> None:
    requests = [GenerationRequest(f"r{i}", p, 20) for i, p in enumerate(PROMPTS)]
    out = run(engine(tiny), requests)
    for i, prompt in enumerate(PROMPTS):
        assert out[f"r{i}"] == [*hf_greedy(tiny, prompt, 20), "length"]


def test_greedy_output_is_the_same_alone_and_in_a_batch(tiny: LlamaForCausalLM) -> None:
    alone = run(engine(tiny), [GenerationRequest("x", PROMPTS[2], 24)])["x"]
    others = [
        GenerationRequest(f"o{i}", p, 30, Sampling(0.9, 0.9, i)) for i, p in enumerate(PROMPTS)
    ]
    together = run(engine(tiny), [*others, GenerationRequest("x", PROMPTS[2], 24)])["x"]
    assert alone == together


def test_seeded_sampling_reproduces_whatever_shares_the_batch(tiny: LlamaForCausalLM) -> None:
    request = GenerationRequest("s", PROMPTS[0], 25, Sampling(1.0, 0.9, 1234))
    alone = run(engine(tiny), [request])["s"]
    crowd = [
        GenerationRequest(f"c{i}", p, 10, Sampling(0.7, 1.0, i)) for i, p in enumerate(PROMPTS)
    ]
    together = run(engine(tiny), [*crowd, request])["s"]
    assert alone == together
    other_seed = GenerationRequest("s", PROMPTS[0], 25, Sampling(1.0, 0.9, 99))
    assert run(engine(tiny), [other_seed])["s"] != alone


def test_max_tokens_and_eos_stop_with_the_right_reason(tiny: LlamaForCausalLM) -> None:
    greedy = hf_greedy(tiny, PROMPTS[1], 10)
    stop_at = greedy[2]
    first = greedy.index(stop_at)
    out = run(engine(tiny, eos=frozenset({stop_at})), [GenerationRequest("e", PROMPTS[1], 10)])
    assert out["e"] == [*greedy[: first + 1], "eos"]
    by_request = GenerationRequest("t", PROMPTS[1], 10, stop_token_ids=(stop_at,))
    assert run(engine(tiny), [by_request])["t"] == [*greedy[: first + 1], "eos"]
    assert run(engine(tiny), [GenerationRequest("l", PROMPTS[1], 3)])["l"] == [
        *greedy[:3],
        "length",
    ]


def test_a_cancelled_request_frees_its_slot_for_the_next_step(tiny: LlamaForCausalLM) -> None:
    eng = engine(tiny, max_seqs=1)
    a, b = Assignment("a", 1), Assignment("b", 1)
    eng.start(a, GenerationRequest("a", PROMPTS[0], 50))
    eng.start(b, GenerationRequest("b", PROMPTS[1], 5))
    first = eng.step()
    assert [e.assignment for e in first] == [a] or first == []  # a prefills, b waits
    eng.stop(a)
    events = eng.step()
    assert events and all(e.assignment == b for e in events)
    assert eng.active == 1


def test_a_request_longer_than_a_slot_fails(tiny: LlamaForCausalLM) -> None:
    out = run(engine(tiny, max_context=20), [GenerationRequest("big", PROMPTS[2], 10)])
    assert out["big"] == ["failed"]


def test_a_request_larger_than_the_whole_kv_pool_fails_and_the_next_runs(
    tiny: LlamaForCausalLM,
) -> None:
    loaded = LoadedModel.from_model(tiny, None, "tiny", frozenset(), 128, "built in the test")
    limits = BatchLimits(max_seqs=4, max_context=128, max_step_tokens=16, max_prefill_tokens=5)
    eng = Engine(loaded, limits, kv_cache_tokens=32)  # two blocks of 16
    big = GenerationRequest("big", PROMPTS[2], 20)  # 19 + 20 positions: three blocks
    small = GenerationRequest("small", PROMPTS[0], 20)  # 7 + 20: two
    out = run(eng, [big, small])
    assert out["big"] == ["failed"]
    assert out["small"] == [*hf_greedy(tiny, PROMPTS[0], 20), "length"]


def test_preemption_and_prefix_sharing_in_a_tiny_pool_change_no_token(
    tiny: LlamaForCausalLM,
) -> None:
    """Six requests, three of them sharing a 16-token prefix, in a pool of five
    blocks: sequences are preempted and recomputed, yet every output equals the
    roomy run's, and every block is back (free or cached) at the end."""
    shared = tuple(range(40, 56))
    prompts = [*PROMPTS, (*shared, 3), (*shared, 4, 5), shared]
    requests = [GenerationRequest(f"q{i}", p, 24) for i, p in enumerate(prompts)]
    roomy = run(engine(tiny), requests)
    loaded = LoadedModel.from_model(tiny, None, "tiny", frozenset(), 128, "built in the test")
    limits = BatchLimits(max_seqs=4, max_context=128, max_step_tokens=16, max_prefill_tokens=5)
    tight = Engine(loaded, limits, kv_cache_tokens=5 * 16)
    assert run(tight, requests) == roomy
    assert tight.preemptions > 0 and tight.blocks.hits > 0
    assert tight.blocks.holders() == 0
    assert tight.blocks.free_blocks() + tight.blocks.cached_blocks() == 5
    report = tight.cache_report()
    assert report.computed_tokens < report.prompt_tokens


def test_decoding_rows_in_groups_gives_the_logits_of_one_gather(tiny: LlamaForCausalLM) -> None:
    """A paged decode of rows whose tables interleave, gathered all at once or in
    groups of rows (the CPU budget), equals each row's prefill of the same tokens."""
    runner = Runner(loaded_of(tiny), 12, 4, 64, "fp32")
    tables = [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    contexts = [torch.tensor(p[:13]) for p in (PROMPTS[2], tuple(range(30, 50)), PROMPTS[2][::-1])]
    expected = []
    for table, context in zip(tables, contexts, strict=True):
        expected.append(runner.prefill(table, 0, context))
        runner.prefill(table, 0, context[:-1])  # the decode below writes the last token
    positions, tokens = torch.tensor([12, 12, 12]), torch.stack([c[-1] for c in contexts])
    pages = runner.pages(tables, 13)
    whole = runner.decode(pages, positions, tokens)
    runner._gather_bytes = 1  # one row per group
    assert len(row_groups(pages, 3, runner._gather_bytes, runner.k_cache[0])) == 3
    grouped = runner.decode(pages, positions, tokens)
    assert torch.allclose(whole, torch.stack(expected), atol=1e-5)
    assert torch.allclose(grouped, whole, atol=1e-6)


def test_out_of_vocabulary_prompt_is_refused(tiny: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        engine(tiny).start(Assignment("v", 1), GenerationRequest("v", (1, VOCAB + 5), 4))


def test_a_sampled_request_without_a_seed_is_refused(tiny: LlamaForCausalLM) -> None:
    """Seeds are drawn in one place, the controller; the engine never makes one up."""
    unseeded = GenerationRequest("u", PROMPTS[0], 4, Sampling(0.8, 1.0, None))
    with pytest.raises(ValueError, match="seed"):
        engine(tiny).start(Assignment("u", 1), unseeded)
    greedy = GenerationRequest("g", PROMPTS[0], 4, Sampling(0.0, 1.0, None))
    assert run(engine(tiny), [greedy])["g"][-1] == "length"


def test_other_architectures_are_refused_clearly() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(UnsupportedModel, match=r"model_type 'gpt2' is not supported \(supported: "):
        LoadedModel.from_model(gpt2, None, "gpt2", frozenset(), 128, "test")


def test_the_engine_thread_streams_events_and_reports_a_broken_step(
    tiny: LlamaForCausalLM,
) -> None:
    received: list[object] = []
    done = threading.Event()

    def on_events(events: list[object]) -> None:
        received.extend(events)
        if any(isinstance(e, DecodeDone | DecoderFailed) for e in events):
            done.set()

    eng = engine(tiny)
    thread = EngineThread(eng, on_events)
    try:
        thread.start(Assignment("t", 1), GenerationRequest("t", PROMPTS[0], 6))
        assert done.wait(30)
        tokens = [e.token_id for e in received if isinstance(e, Decoded)]
        assert tokens == hf_greedy(tiny, PROMPTS[0], 6)
        assert received[-1] == DecodeDone(Assignment("t", 1), "length")

        done.clear()

        def broken(*args: object) -> torch.Tensor:
            raise RuntimeError("device lost")

        eng.runner.decode = broken  # type: ignore[method-assign]
        thread.start(Assignment("u", 1), GenerationRequest("u", PROMPTS[1], 6))
        assert done.wait(30)
        assert isinstance(received[-1], DecoderFailed)
        assert "device lost" in received[-1].message
        assert not eng.has_work()
    finally:
        thread.close()


@pytest.mark.parametrize(
    ("fmt", "bound"),
    [("bf16", 0.01), ("int8", 0.02), ("int4", 0.12), ("w4a16", 0.12), ("w4a8", 0.12)],
)
def test_each_weight_format_stays_close_to_fp32(fmt: str, bound: float) -> None:
    torch.manual_seed(3)
    weight, x = torch.randn(96, 64), torch.randn(16, 64)
    exact = projection(weight, "fp32")(x)
    assert torch.equal(exact, x @ weight.T)
    approx = projection(weight, fmt)(x.to(activation_dtype(fmt))).float()
    assert float((approx - exact).norm() / exact.norm()) < bound


def test_the_format_choice_weighs_both_speeds_and_breaks_near_ties_by_perplexity() -> None:
    quality = {"fp32": 12.33, "w4a16": 12.33, "w4a8": 12.36, "int8": 12.40}
    # AVX2 without VNNI: one byte is clearly faster at one row and at 16
    one, full = {"w4a16": 4.2, "w4a8": 3.7, "int8": 12.0}, {"w4a16": 37.1, "w4a8": 24.1, "int8": 48}
    assert pick(one, full, quality) == "w4a8"
    # AVX-512 VNNI, where the two are within 10% of each other: the better perplexity
    one, full = {"w4a16": 3.8, "w4a8": 3.6}, {"w4a16": 16.0, "w4a8": 15.0}
    assert pick(one, full, quality) == "w4a16"
    # a format fast at one row but slow at full batch loses to one fast at both
    one, full = {"int8": 3.0, "w4a8": 3.7}, {"int8": 60.0, "w4a8": 24.1}
    assert pick(one, full, quality) == "w4a8"
    assert pick({"fp32": 9.0}, {"fp32": 30.0}, quality) == "fp32"


def test_int4_keeps_weights_already_on_a_q4_1_grid() -> None:
    """A GGUF Q4_1 block is 32 values d*q + m: re-packed, they come back nearly exactly."""
    torch.manual_seed(4)
    q = torch.randint(0, 16, (64, 4, 32)).float()
    q[:, :, 0], q[:, :, 1] = 0, 15  # a block's extremes are on the grid's ends, as Q4_1 makes them
    d = torch.rand(64, 4, 1) * 0.01 + 0.001
    m = -torch.rand(64, 4, 1) * 0.05
    weight = (d * q + m).reshape(64, 128)
    x = torch.randn(5, 128)
    packed = projection(weight, "int4")(x.bfloat16()).float()
    exact = x.bfloat16().float() @ weight.T
    assert float((packed - exact).norm() / exact.norm()) < 0.01  # bf16 scales, nothing else


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "w4a16", "w4a8"])
def test_every_format_runs_the_engine_and_predicts_like_fp32(
    tiny: LlamaForCausalLM, fmt: str
) -> None:
    loaded = LoadedModel.from_model(tiny, None, "tiny", frozenset(), 128, "built in the test")
    prompt, table = torch.tensor(PROMPTS[2]), [0, 1, 2, 3]
    reference = Runner(loaded_of(tiny), 4, 16, 64, "fp32").prefill(table, 0, prompt, True)
    logits = Runner(loaded_of(tiny), 4, 16, 64, fmt).prefill(table, 0, prompt, True)
    assert float((logits - reference).norm() / reference.norm()) < 0.1
    limits = BatchLimits(max_seqs=2, max_context=64, max_step_tokens=8, max_prefill_tokens=4)
    out = run(Engine(loaded, limits, weights=fmt), [GenerationRequest("f", PROMPTS[0], 6)])
    assert out["f"][-1] == "length" and len(out["f"]) == 7
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in out["f"][:-1])


def test_a_cpu_always_has_fp32_and_the_choice_covers_only_working_formats() -> None:
    working = working_formats(torch.device("cpu"))
    assert "fp32" in working
    assert set(working) <= set(FORMATS)


def test_the_engine_drives_the_worker_machine_through_cancel_and_finish(
    tiny: LlamaForCausalLM,
) -> None:
    """Worker effects start and stop engine work; engine events go back through the fence."""
    eng = engine(tiny, max_seqs=2)
    worker = Worker(WorkerConfig("w1", slots=2, max_context=128))
    sent: list[object] = []

    def apply(effects: list[object]) -> None:
        for effect in effects:
            match effect:
                case StartDecode(assignment, request):
                    eng.start(assignment, request)
                case StopDecode(assignment):
                    eng.stop(assignment)
                case SendToRouter(message):
                    sent.append(message)

    a, b = Assignment("a", 1), Assignment("b", 1)
    for assignment, prompt, max_new in ((a, PROMPTS[0], 40), (b, PROMPTS[1], 6)):
        request = GenerationRequest(assignment.request_id, prompt, max_new)
        apply(worker.handle(FromRouterMessage(Offer("w1", 0, assignment, request)), 0.0))
    for _ in range(3):
        for event in eng.step():
            apply(worker.handle(event, 0.0))
    apply(worker.handle(FromRouterMessage(Cancel(a)), 0.0))  # the client went away
    while eng.has_work():
        for event in eng.step():
            apply(worker.handle(event, 0.0))
    a_tokens = [m.token_id for m in sent if isinstance(m, Token) and m.assignment == a]
    b_tokens = [m.token_id for m in sent if isinstance(m, Token) and m.assignment == b]
    assert Finished(a, "cancelled", len(a_tokens)) in sent
    assert 1 <= len(a_tokens) <= 3  # nothing of `a` went out after its cancel
    assert b_tokens == hf_greedy(tiny, PROMPTS[1], 6)
    assert Finished(b, "length", 6) in sent
    assert worker.free_slots == 2 and eng.active == 0


def test_the_embedded_runtime_streams_the_engine_off_the_event_loop(
    tiny: LlamaForCausalLM,
) -> None:
    import trio

    from adapters.runtime.controller import Controller
    from adapters.runtime.embedded import run_local_worker
    from adapters.runtime.worker_host import EngineDecoder
    from tests.support.runtime_helpers import collect, settled, wait_until

    requests = [GenerationRequest(f"r{i}", prompt, 12) for i, prompt in enumerate(PROMPTS)]
    direct = run(engine(tiny), requests)

    async def main() -> None:
        controller = Controller()
        decoder = EngineDecoder(engine(tiny), threads=1)
        config = WorkerConfig("engine", slots=4, max_context=128)
        ticks = 0

        async def ticker() -> None:  # runs only if the loop is never blocked for long
            nonlocal ticks
            while True:
                await trio.sleep(0.001)
                ticks += 1

        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            await nursery.start(run_local_worker, controller, config, decoder)
            nursery.start_soon(ticker)
            for request in requests:
                tokens, outcome = await collect(controller.submit(request))
                assert [*tokens, outcome.reason] == direct[request.request_id]  # type: ignore[union-attr]
            await wait_until(controller, settled)
            assert ticks > 0
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.9, 0.95, seed=3)])
def test_a_continuation_from_k_equals_the_uninterrupted_run(
    tiny: LlamaForCausalLM, sampling: Sampling
) -> None:
    whole = GenerationRequest("w", PROMPTS[0], 20, sampling)
    full = run(engine(tiny), [whole])["w"]
    assert full[-1] == "length"
    for k in (1, 7, 19):
        prefix = tuple(int(t) for t in full[:k])  # type: ignore[arg-type]
        cont = GenerationRequest("c", PROMPTS[0], 20, sampling, output_prefix=prefix)
        eng = engine(tiny)
        eng.start(Assignment("c", 2), cont)
        events = []
        while eng.has_work():
            events += eng.step()
        decoded = [e for e in events if isinstance(e, Decoded)]
        assert [e.index for e in decoded] == list(range(k, 20))  # it goes on at index k
        assert [e.token_id for e in decoded] == full[k:20]


def test_a_continuation_of_an_ended_output_ends_at_once(tiny: LlamaForCausalLM) -> None:
    eng = engine(tiny, eos=frozenset({5}))
    eng.start(Assignment("a", 2), GenerationRequest("a", (1, 2), 3, output_prefix=(9, 9, 9)))
    eng.start(Assignment("b", 2), GenerationRequest("b", (1, 2), 9, output_prefix=(9, 5)))
    assert eng.step() == [
        DecodeDone(Assignment("a", 2), "length"),
        DecodeDone(Assignment("b", 2), "eos"),
    ]
    assert not eng.has_work()


def test_the_command_line_offers_exactly_the_engine_formats_and_auto() -> None:
    from adapters.cli import WEIGHT_CHOICES

    assert ("auto", *FORMATS) == WEIGHT_CHOICES
    from adapters.engine.options import NATIVE_FORMATS
    from adapters.engine.weights import NATIVE

    assert NATIVE_FORMATS == NATIVE


def decoded_events(eng: Engine, requests: list[GenerationRequest]) -> dict[str, list[Decoded]]:
    for request in requests:
        eng.start(Assignment(request.request_id, 1), request)
    out: dict[str, list[Decoded]] = {r.request_id: [] for r in requests}
    while eng.has_work():
        for event in eng.step():
            if isinstance(event, Decoded):
                out[event.assignment.request_id].append(event)
    return out


def test_logprob_records_are_the_log_softmax_of_each_rows_draw() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 3
    draws = [TokenDraw(0.0, 1.0, 0, 0), TokenDraw(0.5, 0.9, 7, 3), TokenDraw(1.3, 1.0, 2, 1),
             TokenDraw(0.0, 1.0, 0, 0)]  # fmt: skip
    picks = sample_rows(logits, draws)
    records = logprob_records(logits, picks, draws, [3, 0, 20, None])
    assert records[3] is None  # that row asks for none
    for row, (temperature, top) in enumerate([(1.0, 3), (0.5, 0), (1.3, 20)]):
        record = records[row]
        assert record is not None
        expected = torch.log_softmax(logits[row] / temperature, dim=-1)
        assert record.logprob == pytest.approx(float(expected[picks[row]]), abs=1e-5)
        values, ids = torch.topk(expected, top)
        assert [t for t, _ in record.top] == ids.tolist()
        assert [v for _, v in record.top] == pytest.approx(values.tolist(), abs=1e-5)
    greedy = records[0]
    assert greedy is not None and greedy.top[0] == (picks[0], greedy.logprob)


def test_a_grammar_mask_renormalises_the_reported_distribution() -> None:
    logits = torch.randn(1, VOCAB)
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | (1 << 5) | (1 << 8)  # tokens 3, 5 and 8 allowed
    masked = logits + forbidden_penalty(bitmask, VOCAB, torch.float32)
    draws = [TokenDraw(0.0, 1.0, 0, 0)]
    [record] = logprob_records(masked, [5], draws, [4])
    assert record is not None
    assert {t for t, _ in record.top[:3]} == {3, 5, 8}
    assert record.top[3][1] == float("-inf")  # a forbidden token: no probability at all
    assert sum(math.exp(v) for _, v in record.top) == pytest.approx(1.0)


def test_the_engine_sends_records_only_where_asked_and_a_continuation_agrees(
    tiny: LlamaForCausalLM,
) -> None:
    sampling = Sampling(0.9, 0.95, seed=3)
    asking = GenerationRequest("a", PROMPTS[0], 12, sampling, logprobs=2)
    plain = GenerationRequest("p", PROMPTS[1], 12)
    events = decoded_events(engine(tiny), [asking, plain])
    assert all(e.logprob is None for e in events["p"])
    records = [e.logprob for e in events["a"]]
    assert all(r is not None and len(r.top) == 2 for r in records)
    prefix = tuple(e.token_id for e in events["a"][:5])
    cont = GenerationRequest("a", PROMPTS[0], 12, sampling, output_prefix=prefix, logprobs=2)
    resumed = decoded_events(engine(tiny), [cont])["a"]
    assert [e.token_id for e in resumed] == [e.token_id for e in events["a"][5:]]
    for got, want in zip(resumed, records[5:], strict=True):
        assert got.logprob is not None and want is not None
        assert got.logprob.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.logprob.top] == [t for t, _ in want.top]


def test_the_command_line_offers_exactly_the_decode_paths_and_attentions() -> None:
    from adapters.cli import ATTENTION_CHOICES, DECODE_CHOICES
    from adapters.engine.engine import DECODE_PATHS
    from adapters.engine.paged_attention import ATTENTIONS

    assert DECODE_PATHS == DECODE_CHOICES
    assert ("auto", *ATTENTIONS) == ATTENTION_CHOICES
    from adapters.cli import SPECULATIVE_CHOICES
    from adapters.engine.speculative import SPECULATIVE_KINDS

    assert SPECULATIVE_KINDS == SPECULATIVE_CHOICES
