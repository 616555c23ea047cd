"""API keys and tenants (server/tenancy.py): the keys file's two forms, the environment
variable, the single key, the admin key and the lookup; and keyed page hashing (page_hash.py)."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache.page_hash import PageHashing, namespace_id, namespace_seed, page_hashes, state_hash
from radixserve.cli import build_parser, cache_hash_secret
from radixserve.engine.request import namespace_of, tenant_of
from radixserve.server.tenancy import KEYS_ENV, SINGLE_TENANT, ApiKeys, Caller, load_keys, parse_keys


def test_the_text_and_json_forms_name_the_same_tenants() -> None:
    text = "# tenants\nsk-a acme\n\nsk-b  globex admin\n"
    json_form = '{"keys": [{"key": "sk-a", "tenant": "acme"}, {"key": "sk-b", "tenant": "globex", "admin": true}]}'
    expected = {"sk-a": Caller("acme", False), "sk-b": Caller("globex", True)}
    assert parse_keys(text, "f") == expected
    assert parse_keys(json_form, "f") == expected
    assert parse_keys('[{"key": "sk-a", "tenant": "acme"}]', "f") == {"sk-a": Caller("acme", False)}


@pytest.mark.parametrize("text", ["sk-a", "sk-a acme boss", "sk-a acme admin extra", "sk-a bad/name",
                                  '{"keys": [{"key": "sk-a"}]}', '{"keys": 3}', "{not json",
                                  "sk-a acme\nsk-a globex", '[{"key": "", "tenant": "acme"}]'])
def test_malformed_keys_are_refused_naming_the_source(text: str) -> None:
    with pytest.raises(ValueError, match="^keys.txt: "):
        parse_keys(text, "keys.txt")


def test_the_file_and_the_environment_add_up(tmp_path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("sk-a acme\n")
    keys = load_keys(str(path), {KEYS_ENV: "sk-b globex; sk-c initech admin"})
    assert keys == {"sk-a": Caller("acme", False), "sk-b": Caller("globex", False),
                    "sk-c": Caller("initech", True)}
    assert load_keys(None, {}) == {}


def test_each_key_stands_for_its_caller_and_an_unknown_key_for_none() -> None:
    keys = ApiKeys.of(api_key="single", admin_api_key="root", tenant_keys={"sk-a": Caller("acme", False)})
    assert keys.caller("single") == SINGLE_TENANT
    assert keys.caller("root") == Caller(None, True)
    assert keys.caller("sk-a") == Caller("acme", False)
    for wrong in ("", "sk-", "sk-a ", "SINGLE"):
        assert keys.caller(wrong) is None
    assert ApiKeys.of() is None  # no key at all: the server asks for none
    with pytest.raises(ValueError):
        ApiKeys.of(api_key="sk-a", tenant_keys={"sk-a": Caller("acme", False)})


def test_an_empty_key_is_refused_and_an_empty_variable_is_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty key would make an empty bearer token a key (`RADIXSERVE_ADMIN_API_KEY=` in an
    env file would hand the admin role to `Authorization: Bearer`)."""
    for empty in ("", "  "):
        for options in ({"api_key": empty}, {"admin_api_key": empty}, {"tenant_keys": {empty: Caller("acme", False)}}):
            with pytest.raises(ValueError, match="must not be empty"):
                ApiKeys.of(**options)
    monkeypatch.setenv("RADIXSERVE_API_KEY", "")
    monkeypatch.setenv("RADIXSERVE_ADMIN_API_KEY", "")
    args = build_parser().parse_args(["serve"])
    assert args.api_key is None and args.admin_api_key is None
    monkeypatch.setenv("RADIXSERVE_ADMIN_API_KEY", "root")
    assert build_parser().parse_args(["serve"]).admin_api_key == "root"


def test_a_tenant_sees_only_its_own_namespaces_and_an_admin_all() -> None:
    acme, globex = namespace_of("m", "salt", "acme"), namespace_of("m", "salt", "globex")
    single = namespace_of("m", "salt")
    assert tenant_of(acme) == "acme" and tenant_of(single) is None and tenant_of(None) is None
    tenant = Caller("acme", False)
    assert tenant.sees(acme) and not tenant.sees(globex) and not tenant.sees(single) and not tenant.sees(None)
    assert all(Caller("acme", True).sees(ns) for ns in (acme, globex, single))
    assert all(SINGLE_TENANT.sees(ns) for ns in (acme, globex, single))


def test_without_a_secret_hashing_is_the_public_spec() -> None:
    hashing = PageHashing()
    tokens = np.arange(40, dtype=np.int64)
    ns_id, seed = hashing.named(("m", "s"))
    assert ns_id == namespace_id(("m", "s")) and seed == namespace_seed(ns_id)
    got, end = hashing.page_hashes(tokens, 8, seed)
    want, want_end = page_hashes(tokens, 8, seed)
    assert got.tolist() == want.tolist() and end == want_end
    assert hashing.state_hash(end, seed) == state_hash(end, seed)
    assert hashing.namespace_of_id(ns_id) == ("m", "s") and hashing.namespace_of_id("0" * 16) is None


def test_keyed_hashes_depend_on_the_secret_and_keep_the_chain() -> None:
    tokens = np.arange(40, dtype=np.int64)
    one, same, other = PageHashing("secret"), PageHashing(b"secret"), PageHashing("other")
    seed = one.named(("m", "s"))[1]
    hashes, end = one.page_hashes(tokens, 8, seed)
    assert hashes.tolist() == same.page_hashes(tokens, 8, same.named(("m", "s"))[1])[0].tolist()
    assert one.named(("m", "s")) != other.named(("m", "s"))  # ids and seeds are keyed too
    assert not set(hashes.tolist()) & set(page_hashes(tokens, 8, seed)[0].tolist())
    assert not set(hashes.tolist()) & set(other.page_hashes(tokens, 8, seed)[0].tolist())
    # Continued chains and the parent hash name the same pages as one call does.
    head, state = one.page_hashes(tokens[:16], 8, seed)
    tail, _ = one.page_hashes(tokens[16:], 8, seed, state, 2)
    assert head.tolist() + tail.tolist() == hashes.tolist()
    assert one.state_hash(state, seed) == int(hashes[1])


def test_the_cli_keys_hashes_by_default_and_shares_a_given_secret() -> None:
    parse = build_parser().parse_args
    first, second = cache_hash_secret(parse(["serve"])), cache_hash_secret(parse(["serve"]))
    assert first and second and first != second  # random per start
    assert cache_hash_secret(parse(["serve", "--cache-hash-secret", "shared"])) == "shared"
    assert cache_hash_secret(parse(["serve", "--public-cache-hashes"])) is None
