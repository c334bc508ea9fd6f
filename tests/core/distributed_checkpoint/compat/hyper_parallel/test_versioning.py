"""migrate_metadata at HyperParallel's path: a chain of one-step rules up to the current version.

HyperParallel's record has torch DCP's fields (``state_dict_metadata``, ``version``), so torch's
``Metadata`` stands for it here; our format record (integer ``version``) is accepted too.
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.metadata import Metadata as SeedShaped

from hyper_parallel.core.distributed_checkpoint import versioning
from hyper_parallel.core.distributed_checkpoint._src.format import versioning as real
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import FORMAT_VERSION, Metadata
from hyper_parallel.core.distributed_checkpoint.versioning import CURRENT_CHECKPOINT_VERSION, migrate_metadata


@pytest.fixture
def seed_rules(monkeypatch):
    """A private copy of the face's rule table, so a test may add or break rules."""
    rules = dict(versioning._MIGRATION_RULES)
    monkeypatch.setattr(versioning, "_MIGRATION_RULES", rules)
    return rules


def test_a_current_record_is_returned_as_it_is():
    md = SeedShaped(state_dict_metadata={"w": BytesStorageMetadata()}, version=CURRENT_CHECKPOINT_VERSION)
    assert migrate_metadata(md) is md and md.version == "2.0"


def test_a_record_without_its_own_version_counts_as_1_0_and_is_stamped():
    md = SeedShaped(state_dict_metadata={"w": BytesStorageMetadata()}, version="1.0")
    del md.__dict__["version"]  # what unpickling a record from before the field gives
    out = migrate_metadata(md)
    assert out.version == CURRENT_CHECKPOINT_VERSION and "w" in out.state_dict_metadata


def test_torch_default_version_none_counts_as_1_0():
    assert migrate_metadata(SeedShaped(state_dict_metadata={})).version == CURRENT_CHECKPOINT_VERSION


def test_our_format_record_is_current_and_keeps_an_integer_version():
    md = Metadata(entries={}, save_id="s", world_size=1)
    assert md.version == FORMAT_VERSION == 3
    assert migrate_metadata(md) is md and md.version == 3


@pytest.mark.parametrize("version", ["0.5", "abc"])
def test_a_version_without_a_rule_names_it_and_the_current_one(version):
    with pytest.raises(ValueError, match=f"'{version}'.*'2.0'.*no migration rule"):
        migrate_metadata(SeedShaped(state_dict_metadata={}, version=version))


def test_a_version_newer_than_this_code_says_to_upgrade():
    with pytest.raises(ValueError, match="'3.0'.*newer code.*upgrade"):
        migrate_metadata(SeedShaped(state_dict_metadata={}, version="3.0"))


def test_rules_chain_one_step_at_a_time(seed_rules, monkeypatch):
    calls = []

    def step(to):
        def rule(md):
            calls.append((md.version, to))
            md.version = to
            return md
        return rule

    seed_rules["0.9"] = step("1.0")
    seed_rules["1.0"] = step("2.0")
    out = migrate_metadata(SeedShaped(state_dict_metadata={}, version="0.9"))
    assert out.version == "2.0" and calls == [("0.9", "1.0"), ("1.0", "2.0")]


def test_a_rule_that_does_not_advance_is_refused(seed_rules):
    seed_rules["1.0"] = lambda md: md
    with pytest.raises(ValueError, match="'1.0' did not advance"):
        migrate_metadata(SeedShaped(state_dict_metadata={}, version="1.0"))


def test_a_rule_returning_something_else_names_what_it_returned(seed_rules):
    seed_rules["1.0"] = lambda md: {"version": "2.0"}
    with pytest.raises(ValueError, match="returned dict, not a metadata record"):
        migrate_metadata(SeedShaped(state_dict_metadata={}, version="1.0"))


def test_a_rule_jumping_past_the_current_version_is_refused(seed_rules):
    def jump(md):
        md.version = "9.0"
        return md

    seed_rules["1.0"] = jump
    with pytest.raises(ValueError, match="'9.0', newer than the current '2.0'"):
        migrate_metadata(SeedShaped(state_dict_metadata={}, version="1.0"))


def test_rules_that_loop_are_refused(seed_rules):
    def back(md):
        md.version = "1.0"
        return md

    def fwd(md):
        md.version = "1.5"
        return md

    seed_rules["1.0"], seed_rules["1.5"] = fwd, back
    with pytest.raises(ValueError, match="loop"):
        migrate_metadata(SeedShaped(state_dict_metadata={}, version="1.0"))


def test_the_seed_path_owns_its_table_and_swapping_it_leaves_the_package_table_alone(seed_rules):
    seed_rules["1.0"] = lambda md: md
    assert real.MIGRATION_RULES["1.0"] is not seed_rules["1.0"]
    assert real.migrate_metadata(SeedShaped(state_dict_metadata={}, version="1.0")).version == "2.0"


def test_something_that_is_not_a_record_is_a_type_error():
    with pytest.raises(TypeError, match="found dict"):
        migrate_metadata({"version": "1.0"})
