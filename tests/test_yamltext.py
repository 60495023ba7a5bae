"""appliance.core.yamltext: whatever it writes, a YAML reader reads back as the same data (the
manifests of `appliance train k8s`), and the same data gives the same bytes."""

import yaml
from hypothesis import given, settings, strategies as st

from appliance.core.yamltext import dump, dump_all

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=30), st.sampled_from(["yes", "no", "on", "1.10", "0x1F", "~", "- x", "a: b",
                                                           "line\n", "two\nlines\n", "  indented\n", "#x\n", ""]))
keys = st.one_of(st.text(max_size=12), st.sampled_from(["yes", "n", "1e3", "nvidia.com/gpu", "-x", "a b", "null"]))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(keys, inner, max_size=4)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(documents)
def test_every_document_reads_back_as_written(data):
    text = dump(data)
    assert yaml.safe_load(text) == data, text
    assert dump(data) == text


def test_scripts_are_literal_blocks_and_the_header_is_comments():
    text = dump_all([{"command": ["sh", "-c", "rank=${HOSTNAME##*-}\nexec train \"$rank\"\n"]}], "made by\nus")
    assert text.startswith("# made by\n# us\n---\ncommand:\n") and "- |\n    rank=${HOSTNAME##*-}\n" in text
    assert list(yaml.safe_load_all(text)) == [{"command": ["sh", "-c", "rank=${HOSTNAME##*-}\nexec train \"$rank\"\n"]}]
