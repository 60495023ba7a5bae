"""`appliance data ...`: the data verbs (check, preview); each sub-verb lives in its own module."""

from __future__ import annotations


def register(subparsers) -> None:
    data = subparsers.add_parser("data", help="check and inspect TFRecord data",
                                 description="Data verbs: check (quality gate), preview (augmentation grid).")
    verbs = data.add_subparsers(dest="data_verb", metavar="DATA_VERB", required=True)
    from data_tools.check.cli import register as register_check
    from data_tools.preview import register as register_preview

    register_check(verbs)
    register_preview(verbs)
