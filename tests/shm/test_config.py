"""ShmConfig: every COLLECTIVES_SHM_* setting read in one place, and a bad value names its variable."""

from __future__ import annotations

import dataclasses

import pytest

from collectives.shm.config import ShmConfig


def test_defaults_without_the_variables():
    c = ShmConfig.from_env({})
    assert (c.slot_bytes, c.inline_bytes, c.mailbox_bytes, c.piece_bytes, c.cma, c.cma_min_bytes, c.wait,
            c.path, c.worker_nice, c.round_kb, c.regions) == (64 << 20, 64 << 10, 256 << 10, 1 << 20, "0", 16 << 20,
                                                              "futex", "native", 19, "auto", "2")


@pytest.mark.parametrize("regions, round_bytes, expected", [
    ("2", 1 << 20, 2),           # the default: the two halves' first MiB each
    ("auto", 1 << 20, 64),       # a 64 MiB slot in 1 MiB regions, all used in turn
    ("auto", 32 << 20, 2),       # half-slot rounds: the two halves
    ("3", 1 << 20, 3),
    ("3.0", 1 << 20, 3),         # read as the whole number it is
    ("1000", 1 << 20, 64),       # at most as many as fit
])
def test_the_rounds_use_as_many_regions_of_a_slot_as_set_or_as_fit(regions, round_bytes, expected):
    assert ShmConfig.from_env({"COLLECTIVES_SHM_REGIONS": regions}).region_count(round_bytes) == expected


@pytest.mark.parametrize("round_kb, world_size, cores, expected", [
    ("auto", 2, 2, 1 << 20),     # a core each: 1 MiB rounds
    ("auto", 2, 16, 1 << 20),
    ("auto", 4, 2, 32 << 20),    # ranks share cores: half a 64 MiB slot
    ("auto", 3, 2, 32 << 20),
    ("100", 4, 2, 100 << 10),    # set: whatever the cores
    ("0.1", 2, 2, 64),           # at least 64 bytes, a multiple of 64
    ("1.5", 2, 2, 1536),
    ("1024.0", 2, 2, 1 << 20),
    ("1048576", 2, 2, 32 << 20),
    ("65536", 2, 2, 32 << 20),   # at most half a slot
])
def test_the_round_size_follows_the_setting_or_the_cores_the_ranks_have(round_kb, world_size, cores, expected):
    c = ShmConfig.from_env({"COLLECTIVES_SHM_ROUND_KB": round_kb})
    assert c.round_bytes(world_size, cores) == expected


def test_each_variable_reaches_its_field():
    c = ShmConfig.from_env({"COLLECTIVES_SHM_SLOT_MB": "0.5", "COLLECTIVES_SHM_INLINE_BYTES": "0",
                            "COLLECTIVES_SHM_MAILBOX_KB": "3", "COLLECTIVES_SHM_PIECE_KB": "4",
                            "COLLECTIVES_SHM_CMA": "auto", "COLLECTIVES_SHM_CMA_MIN_KB": "256",
                            "COLLECTIVES_SHM_WAIT": "yield", "COLLECTIVES_SHM_PATH": "python",
                            "COLLECTIVES_SHM_WORKER_NICE": "0", "COLLECTIVES_SHM_ROUND_KB": "8"})
    assert (c.slot_bytes, c.inline_bytes, c.piece_bytes, c.cma, c.cma_min_bytes, c.wait, c.path, c.worker_nice,
            c.round_kb) == (512 << 10, 0, 4096, "auto", 256 << 10, "yield", "python", 0, "8")
    assert c.mailbox_bytes == 3072 and c.mailbox_bytes % 128 == 0  # halves stay 64-byte aligned


@pytest.mark.parametrize("var, value, says", [
    ("COLLECTIVES_SHM_SLOT_MB", "big", "must be a number"),
    ("COLLECTIVES_SHM_SLOT_MB", "0", "must be a positive number"),
    ("COLLECTIVES_SHM_PIECE_KB", "nan", "must be a positive number"),
    ("COLLECTIVES_SHM_MAILBOX_KB", "-1", "must be a positive number"),
    ("COLLECTIVES_SHM_CMA", "yes", "must be one of auto, 1, on, 0, off"),
    ("COLLECTIVES_SHM_ROUND_KB", "some", "must be auto or a number"),
    ("COLLECTIVES_SHM_ROUND_KB", "0", "must be a positive number"),
    ("COLLECTIVES_SHM_REGIONS", "1", "must be auto or a whole number from 2 to 65536"),
    ("COLLECTIVES_SHM_REGIONS", "2.5", "must be auto or a whole number from 2 to 65536"),
    ("COLLECTIVES_SHM_REGIONS", "many", "must be auto or a number"),
    ("COLLECTIVES_SHM_WAIT", "nap", "must be one of futex, spin, yield, sleep"),
    ("COLLECTIVES_SHM_WORKER_NICE", "20", "must be a whole number from 0 to 19"),
    ("COLLECTIVES_SHM_WORKER_NICE", "2.5", "must be a whole number from 0 to 19"),
    ("COLLECTIVES_SHM_WORKER_NICE", "-1", "must be a whole number from 0 to 19"),
])
def test_a_bad_value_is_an_error_naming_the_variable(var, value, says):
    with pytest.raises(ValueError) as info:
        ShmConfig.from_env({var: value})
    assert str(info.value) == f"{var}={value!r}: {says}"


# Every numeric setting at both edges: (lowest taken, just below it, highest taken, just above it).
# A bound that refuses its own edge (the documented default 19 of WORKER_NICE, once) fails here.
EDGES = {
    "COLLECTIVES_SHM_SLOT_MB": ("1e-6", "0", str(1 << 20), str((1 << 20) + 1)),
    "COLLECTIVES_SHM_INLINE_BYTES": ("0", "-1", str(1 << 40), str((1 << 40) + 1)),
    "COLLECTIVES_SHM_MAILBOX_KB": ("1e-6", "0", str(1 << 30), str((1 << 30) + 1)),
    "COLLECTIVES_SHM_PIECE_KB": ("1e-6", "0", str(1 << 30), "1e30"),
    "COLLECTIVES_SHM_CMA_MIN_KB": ("1e-6", "0", str(1 << 30), str((1 << 30) + 1)),
    "COLLECTIVES_SHM_ROUND_KB": ("1e-6", "0", str(1 << 30), str((1 << 30) + 1)),
    "COLLECTIVES_SHM_REGIONS": ("2", "1", "65536", "65537"),
    "COLLECTIVES_SHM_WORKER_NICE": ("0", "-1", "19", "20"),
}


def test_every_numeric_setting_has_its_edges_tested():
    numeric = {"COLLECTIVES_SHM_" + f.name.upper() for f in dataclasses.fields(ShmConfig)
               if f.name not in ("cma", "wait", "path")}
    assert set(EDGES) == numeric


@pytest.mark.parametrize("var", sorted(EDGES))
def test_each_numeric_setting_takes_its_edges_and_refuses_past_them(var):
    low, below, high, above = EDGES[var]
    for value in (low, high):
        ShmConfig.from_env({var: value})
    for value in (below, above, "inf"):
        with pytest.raises(ValueError) as info:
            ShmConfig.from_env({var: value})
        assert str(info.value).startswith(f"{var}={value!r}: must be"), str(info.value)


def test_an_empty_path_setting_is_the_default_native_path_for_every_reader(monkeypatch):
    """The settings module says what a value means: the launcher's 'does this world record?'
    must read COLLECTIVES_SHM_PATH= as the backend does (native), and unset as native too."""
    from collectives.flight_recorder import recording

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    for value in (None, "", "native"):
        if value is None:
            monkeypatch.delenv("COLLECTIVES_SHM_PATH", raising=False)
        else:
            monkeypatch.setenv("COLLECTIVES_SHM_PATH", value)
        assert ShmConfig.from_env().path == "native" and recording("shm"), value
    monkeypatch.setenv("COLLECTIVES_SHM_PATH", "python")
    assert not recording("shm") and not recording("gloo")


def test_the_flight_recorders_size_is_bounded_by_what_a_rank_can_hold(monkeypatch):
    from collectives import settings

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", str(settings.MAX_FR_ENTRIES))
    assert settings.fr_buffer_size() == settings.MAX_FR_ENTRIES
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100000000")
    with pytest.raises(ValueError, match=r"TORCH_FR_BUFFER_SIZE='100000000': at most 1000000 entries .* 22.4 GB here"):
        settings.fr_buffer_size()


def test_a_segment_too_large_names_the_setting_that_made_it_so():
    from collectives.shm.segment import too_large

    slots = too_large(200 << 30, 20 << 30, 2, 100 << 30, 4 * (256 << 10))
    assert "the data slots (2 x 100.0 GiB) take 200.0 GiB of it, so set COLLECTIVES_SHM_SLOT_MB lower" in slots, slots
    assert slots.endswith("; the mailboxes (2 x 2 x 256.0 KiB) take 1.0 MiB"), slots
    mail = too_large(100 << 30, 20 << 30, 2, 64 << 20, 4 * (25 << 30))
    assert "the mailboxes (2 x 2 x 25.0 GiB) take 100.0 GiB of it, so set COLLECTIVES_SHM_MAILBOX_KB lower" in mail, mail


def _never_called(env):
    raise AssertionError("a rank started")


@pytest.mark.parametrize("var, value, backend, says", [
    ("COLLECTIVES_SHM_SLOT_MB", "lots", "shm", "COLLECTIVES_SHM_SLOT_MB='lots': must be a number"),
    ("COLLECTIVES_SHM_WAIT", "bogus", "shm", "COLLECTIVES_SHM_WAIT='bogus': must be one of"),
    ("TORCH_FR_BUFFER_SIZE", "-5", "shm", "TORCH_FR_BUFFER_SIZE='-5' is not a whole number of entries"),
    ("TORCH_FR_BUFFER_SIZE", "100000000", "gloo", "TORCH_FR_BUFFER_SIZE='100000000': at most 1000000 entries"),
    ("COLLECTIVES_SHM_INLINE_BYTES", "1e30", "shm", "COLLECTIVES_SHM_INLINE_BYTES='1e30': must be at most"),
    ("COLLECTIVES_SHM_PIECE_KB", "1e30", "shm", "COLLECTIVES_SHM_PIECE_KB='1e30': must be at most"),
])
def test_a_bad_setting_stops_the_run_before_any_rank_starts(var, value, backend, says, monkeypatch):
    """Read the same way as the shm backend's own: named, in the launcher, not in every rank."""
    import collectives
    from collectives.launcher import pool

    monkeypatch.setenv(var, value)
    monkeypatch.setattr(pool, "rank_context", lambda method: (_ for _ in ()).throw(AssertionError("a rank started")))
    with pytest.raises(ValueError) as info:
        collectives.run(_never_called, 2, backend=backend)
    assert str(info.value).startswith(says), str(info.value)


@pytest.mark.parametrize("value, size", [(None, 0), ("0", 0), ("2000", 2000), (" 7 ", 7), ("", None), ("2k", None)])
def test_the_flight_recorder_setting_reads_whole_numbers(value, size, monkeypatch):
    """As torch reads it (an empty value aborts its ranks too), for every reader here."""
    from collectives import settings

    if value is None:
        monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    else:
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", value)
    if size is None:
        with pytest.raises(ValueError, match="is not a whole number of entries"):
            settings.fr_buffer_size()
    else:
        assert settings.fr_buffer_size() == size


@pytest.mark.parametrize("value, says", [("x", "N='x': must be a whole number of at least 1"),
                                         ("0", "N='0': must be a whole number of at least 1")])
def test_a_whole_number_setting_names_the_variable(value, says, monkeypatch):
    from collectives import settings

    monkeypatch.setenv("N", value)
    with pytest.raises(ValueError, match=says):
        settings.whole("N", 5, least=1)
    monkeypatch.setenv("N", "")
    assert settings.whole("N", 5, least=1) == 5
