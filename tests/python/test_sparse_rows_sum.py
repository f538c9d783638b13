"""sparse_rows_sum_: a sparse gradient's lookups summed per row in FP32, with the unscale and
the inf/NaN check in the same read of the values (the CPU's half of a sparse step; on other
devices the step keeps a separate check, so the op exists on the CPU alone). Its sums, handed to
a step op as indices and values, give the bits of that op given the lookups themselves."""
import pytest
import torch

from sparse_helpers import DIM, OPS, ROWS

sum_ = torch.ops.fusedamp.sparse_rows_sum_
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def lookups(gen, dtype, nnz=400, scale=4.0):
    idx = (torch.rand(nnz, generator=gen) ** 2 * ROWS).long()
    return idx[None], (torch.randn(nnz, DIM, generator=gen) * scale).to(dtype)


def reference(idx, values):
    """Rows in first-lookup order and each row's lookups added one by one in FP32."""
    rows, sums = [], {}
    for k, r in enumerate(idx.reshape(-1).tolist()):
        v = values[k].float()
        if r not in sums:
            rows.append(r)
            sums[r] = v.clone()
        else:
            sums[r] = sums[r] + v
    return torch.tensor(rows, dtype=torch.long), torch.stack([sums[r] for r in rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv", [None, 0.25, 3.0])
def test_sums_rows_in_first_lookup_order_and_unscales_in_place(dtype, inv):
    gen = torch.Generator().manual_seed(3)
    idx, values = lookups(gen, dtype)
    expected_values = values if inv is None else (values.float() * inv).to(dtype)
    want_rows, want_sums = reference(idx, expected_values)
    found = torch.zeros(())
    inv_scale = None if inv is None else torch.full((), inv)
    rows, sums = sum_(idx, values, ROWS, found, inv_scale=inv_scale)
    assert torch.equal(rows, want_rows)
    assert sums.dtype == torch.float32
    assert torch.equal(sums, want_sums)  # bit for bit: the same additions in the same order
    assert torch.equal(values, expected_values)
    assert found.item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_found_inf_is_set_for_any_non_finite_sum_and_otherwise_left(dtype):
    gen = torch.Generator().manual_seed(4)
    idx, values = lookups(gen, dtype)
    found = torch.ones(())  # set by an earlier table: left set
    sum_(idx, values.clone(), ROWS, found)
    assert found.item() == 1
    for bad in (float("inf"), float("nan"), -float("inf")):
        found = torch.zeros(())
        broken = values.clone()
        broken[7, 3] = bad
        sum_(idx, broken, ROWS, found)
        assert found.item() == 1
    # A finite FP16 value that overflows only once unscaled (a scale below 1).
    if dtype == torch.float16:
        found = torch.zeros(())
        big = values.clone()
        big[5, 0] = 30000.0
        sum_(idx, big, ROWS, found, inv_scale=torch.full((), 4.0))
        assert found.item() == 1


def test_bad_input_is_refused_before_anything_is_written():
    gen = torch.Generator().manual_seed(5)
    idx, values = lookups(gen, torch.float16)
    found, before = torch.zeros(()), values.clone()
    out_of_range = idx.clone()
    out_of_range[0, -1] = ROWS
    cases = [
        ((out_of_range, values, ROWS, found), "out of range"),
        ((idx, values, -1, found), "num_rows"),
        ((idx.float(), values, ROWS, found), "indices must be int64"),
        ((idx, values[:, :, None], ROWS, found), "values must be"),
        ((idx, values.t().contiguous().t(), ROWS, found), "contiguous"),
        ((idx, values, ROWS, torch.zeros(2)), "found_inf"),
        ((idx, values.int(), ROWS, found), "float32, float16 or bfloat16"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            sum_(*args, inv_scale=torch.full((), 0.5))
        assert torch.equal(values, before) and found.item() == 0


@pytest.mark.parametrize("values_dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_step_given_the_sums_has_the_bits_of_the_step_given_the_lookups(op, values_dtype):
    """Three steps of each op on an FP16 table with its master and on an FP32 table, once from
    the lookups unscaled as unscale_and_check_ leaves them and once from sparse_rows_sum_'s
    sums of the same lookups unscaled in it."""
    name, state, kwargs = OPS[op]
    fn = getattr(torch.ops.fusedamp, name)
    gen = torch.Generator().manual_seed(6)
    master = torch.randn(ROWS, DIM, generator=gen)
    shapes = {"table": (ROWS, DIM), "rows": (ROWS,)}
    states = [None if s is None else torch.rand(shapes[s], generator=gen) * 0.1 for s in state]
    for table, mst in ((master.half(), master.clone()), (master.clone(), None)):
        sides = [[t.clone() if t is not None else None for t in [table, mst, None, None] + states
                  + [torch.zeros(())]] for _ in range(2)]
        for _ in range(3):
            idx, values = lookups(gen, values_dtype)
            inv = torch.full((), 1 / 3)  # inexact: the unscaled values round
            lookups_side, sums_side = sides
            lookups_side[2], lookups_side[3] = idx, (values.float() * inv).to(values_dtype)
            fn(*lookups_side, **kwargs, found_inf=torch.zeros(()))
            found = torch.zeros(())
            sums_side[2], sums_side[3] = sum_(idx, values.clone(), ROWS, found, inv_scale=inv)
            fn(*sums_side, **kwargs, found_inf=found)
        for i, (a, b) in enumerate(zip(*sides)):
            if i not in (2, 3) and a is not None:
                assert torch.equal(a.reshape(-1).view(torch.uint8),
                                   b.reshape(-1).view(torch.uint8)), (op, i)


def test_optimizer_under_a_scaler_steps_as_its_op_given_the_lookups():
    """The engine's CPU step (sparse_rows_sum_ then the op on the sums), two FP16 tables with
    FP32 master rows under a loss scale of 3: each table, master and state has the bits of the
    op given the lookups unscaled, and .grad is left so, as torch leaves it."""
    import fusedamp

    gen = torch.Generator().manual_seed(8)
    start = [torch.randn(ROWS, DIM, generator=gen) for _ in range(2)]
    params = [torch.nn.Parameter(w.half()) for w in start]
    opt = fusedamp.optim.Adagrad(params, lr=0.1)
    scaler = fusedamp.GradScaler("cpu", init_scale=3.0)
    refs = [[w.half(), w.half().float(), torch.zeros(ROWS, DIM), torch.zeros(())] for w in start]
    for _ in range(3):
        scaler.scale(torch.ones(()))
        for p, ref in zip(params, refs):
            idx, values = lookups(gen, torch.float16, scale=6.0)
            p.grad = torch.sparse_coo_tensor(idx, values, (ROWS, DIM))
            p.unscaled = (values.float() * torch.full((), 1 / 3)).half()
            torch.ops.fusedamp.sparse_adagrad_step_(
                ref[0], ref[1], idx, p.unscaled.clone(), ref[2], ref[3], lr=0.1, lr_decay=0.0,
                eps=1e-10, found_inf=torch.zeros(()))
        scaler.step(opt)
        scaler.update()
        for p in params:
            assert torch.equal(p.grad._values(), p.unscaled)
    for p, (table, master, state_sum, step) in zip(params, refs):
        state = opt.state[p]
        assert torch.equal(p.detach(), table)
        assert torch.equal(state["master_param"], master)
        assert torch.equal(state["sum"], state_sum)
        assert state["step"].item() == step.item() == 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [DIM, 37, 5])  # a tail pair on every instruction set
@pytest.mark.parametrize("nnz", [300, 2000])  # one block of ~4,096 values, and several
def test_statistics_in_the_same_read_are_grad_stats_over_the_values(dtype, dim, nnz):
    """telemetry and sum_sq, gathered while summing, as grad_stats_ finds them over the values
    tensor (before unscaling): amax, counts below the smallest normal and of zeros (the zero
    lanes past a row's or a block's end left out), the first non-finite position, the sum of
    squares. Rows shorter than 32 values are read flat, block by block; longer ones row by row."""
    gen = torch.Generator().manual_seed(12)
    idx = (torch.rand(nnz, generator=gen) ** 2 * ROWS).long()[None]
    values = torch.randn(nnz, dim, generator=gen) * 8
    values[::7] = 0.0
    values[3, :2] = 1e-39 if dtype != torch.float16 else 3e-6  # subnormal in its dtype
    values = values.to(dtype)
    for broken in (False, True):
        if broken:
            values[11, 1] = float("inf")
        want_slots = torch.tensor([0.0, 0.0, 0.0, float("inf")], dtype=torch.float64)
        want_sq = torch.zeros(1)
        torch.ops.fusedamp.grad_stats_([values.clone()], torch.zeros(()), want_sq,
                                       telemetry=want_slots)
        slots = torch.tensor([0.0, 0.0, 0.0, float("inf")], dtype=torch.float64)
        sq = torch.zeros(1)
        sum_(idx, values.clone(), ROWS, torch.zeros(()), inv_scale=torch.full((), 0.5),
             telemetry=slots, sum_sq=sq)
        assert torch.equal(slots, want_slots), (slots, want_slots)
        assert slots[1] > 0 and slots[2] > 0  # subnormals and zeros were seen
        if broken:
            assert slots[3] == 0
        else:
            torch.testing.assert_close(sq, want_sq, rtol=1e-5, atol=0)


def test_position_places_the_values_in_the_telemetrys_list():
    """position: where these values stand in the gradient list the telemetry counts. A
    non-finite lookup makes it the first non-finite position unless an earlier one is held; a
    negative position is refused before anything is written."""
    gen = torch.Generator().manual_seed(17)
    idx, values = lookups(gen, torch.float16)
    values[5, 0] = float("nan")
    for held, want in ((float("inf"), 3.0), (1.0, 1.0)):
        slots = torch.tensor([0.0, 0.0, 0.0, held], dtype=torch.float64)
        sum_(idx, values.clone(), ROWS, torch.zeros(()), telemetry=slots, sum_sq=torch.zeros(1),
             position=3)
        assert slots[3] == want
    slots = torch.tensor([0.0, 0.0, 0.0, float("inf")], dtype=torch.float64)
    given, found = values.clone(), torch.zeros(())
    with pytest.raises(ValueError, match="position must be >= 0"):
        sum_(idx, given, ROWS, found, inv_scale=torch.full((), 0.5), telemetry=slots,
             sum_sq=torch.zeros(1), position=-1)
    assert torch.equal(given.view(torch.int16), values.view(torch.int16))  # NaN included
    assert found == 0 and slots[3] == float("inf")


def test_a_scaler_records_the_tables_lookups():
    """fusedamp.GradScaler's telemetry row of a step of tables alone: the lookups' amax and
    norm (unscaled) and their underflow, where without them the row had no gradients."""
    import fusedamp

    gen = torch.Generator().manual_seed(13)
    p = torch.nn.Parameter(torch.randn(ROWS, DIM, generator=gen).half())
    opt = fusedamp.optim.RowWiseAdagrad([p], lr=0.1)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 4)
    scaler.scale(torch.ones(()))
    idx, values = lookups(gen, torch.float16)
    scaled = values * 16
    p.grad = torch.sparse_coo_tensor(idx, scaled.clone(), (ROWS, DIM))
    scaler.step(opt)
    scaler.update()
    row = {k: v[-1] for k, v in scaler.telemetry().items() if isinstance(v, list) and v}
    assert row["amax"] == scaled.float().abs().max().item()
    torch.testing.assert_close(row["grad_norm"], values.double().norm().item(), rtol=1e-5,
                               atol=0)
    assert row["underflow_fraction"] == 0.0 and not row["found_inf"]


def test_the_telemetry_names_the_table_whose_lookups_overflowed():
    """Three tables recorded pass after pass into one row: an inf in the third (then in the
    second) table's lookups is named as that table, the amax is the largest finite lookup of
    all three, and a step without one names none."""
    import fusedamp

    gen = torch.Generator().manual_seed(16)
    tables = torch.nn.ParameterDict({name: torch.nn.Parameter(
        torch.randn(ROWS, DIM, generator=gen).half()) for name in ("user", "item", "query")})
    opt = fusedamp.optim.Adagrad(tables.parameters(), lr=0.1)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 4)
    for poisoned in ("query", "item", None):
        scaler.scale(torch.ones(()))
        largest = 0.0
        for name, p in tables.items():
            idx, values = lookups(gen, torch.float16)
            if name == poisoned:
                values[7, 3] = float("inf")
            finite = values.float().abs()
            largest = max(largest, finite[finite.isfinite()].max().item())
            p.grad = torch.sparse_coo_tensor(idx, values, (ROWS, DIM))
        scaler.step(opt)
        scaler.update()
        row = {k: v[-1] for k, v in scaler.telemetry(tables).items() if isinstance(v, list)}
        assert row["first_nonfinite"] == poisoned and row["found_inf"] == (poisoned is not None)
        assert row["amax"] == largest


def test_non_contiguous_lookup_values_step_and_unscale_as_contiguous_ones():
    """A COO gradient may hold strided values: the step (CPU tables: the op unscales in place)
    goes through a contiguous copy, and .grad still ends unscaled, as with contiguous ones."""
    import fusedamp

    gen = torch.Generator().manual_seed(14)
    start = torch.randn(ROWS, DIM, generator=gen)
    runs = []
    for contiguous in (True, False):
        p = torch.nn.Parameter(start.half())
        opt = fusedamp.optim.Adagrad([p], lr=0.1)
        scaler = fusedamp.GradScaler("cpu", init_scale=3.0)
        g = torch.Generator().manual_seed(15)
        for _ in range(3):
            idx, values = lookups(g, torch.float16)
            unscaled = (values.float() * (1 / 3)).half()
            strided = values if contiguous else values.t().contiguous().t()
            assert strided.is_contiguous() == contiguous
            p.grad = torch.sparse_coo_tensor(idx, strided, (ROWS, DIM))
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
            assert torch.equal(p.grad._values(), unscaled)
        runs.append(p.detach())
    assert torch.equal(runs[0], runs[1])
