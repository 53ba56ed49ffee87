"""PromQL as the deploy tests read it: the series a query selects (by name, the jobs its
`job` matcher names, the labels it asks to be present), and the samples an exposition
has, so that a test can check every series a dashboard or an alert reads is on a live
deployment's /metrics."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

# what is not a selector: a range, or the label list of by, without, on, ignoring, group_left/right
NOT_SELECTORS = re.compile(r"\[[^\]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
SELECTOR = re.compile(r"\b([a-zA-Z_:][\w:]*)\b(?!\s*\()\s*(\{[^}]*\})?")
OPERATORS = {"and", "or", "unless", "bool", "offset"}
JOB = re.compile(r'\bjob\s*(=~|=)\s*"([^"]*)"')
PRESENT = re.compile(r'\b(\w+)\s*!=\s*""')  # a matcher asking for samples that have the label


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Each series selector of a PromQL expression: (metric name, the jobs its `job`
    matcher names; empty without one). Function calls, numbers and label lists are not."""
    return [(name, jobs) for name, jobs, _ in labelled_selectors(expr)]


def labelled_selectors(expr: str) -> list[tuple[str, set[str], set[str]]]:
    """selectors(), each with the labels its samples must have (`label!=""`)."""
    found = []
    for match in SELECTOR.finditer(NOT_SELECTORS.sub(" ", expr)):
        name, matchers = match.group(1), match.group(2) or ""
        if name not in OPERATORS:
            jobs = {job for op, value in JOB.findall(matchers) for job in (value.split("|") if op == "=~" else [value])}
            found.append((name, jobs, set(PRESENT.findall(matchers))))
    return found


def sample_labels(text: str) -> dict[str, set[str]]:
    """Each sample name of an exposition (a histogram's _bucket, _sum, _count; a counter's
    _total) -> the label names its samples have."""
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels
