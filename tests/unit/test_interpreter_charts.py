"""What a figure or a DataFrame holds, as data: the box's interpreter
(``sandlot.guest.interpreter``) reading charts back from real matplotlib figures on
this host's matplotlib (the boxes' images have others: tests/vm/test_interpreter.py
reads them in a box), and E2B's SDK taking them, through the E2B face's result
fields, as its own typed ``result.chart`` and ``result.data`` (and a string's text
bare, as E2B's interpreter gives it)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest

from sandlot.api.code import Result
from sandlot.guest import interpreter
from sandlot.server.e2b.interpreter import result_fields

plt = pytest.importorskip(
    "matplotlib.pyplot", reason="matplotlib is in the dev extra (pip install -e '.[dev]')"
)


@pytest.fixture(autouse=True)
def figures() -> Iterator[None]:
    plt.switch_backend("Agg")
    yield
    plt.close("all")


def chart() -> dict[str, Any]:
    bundle = interpreter.figure_bundle(plt.gcf())
    assert bundle["image/png"]
    found: dict[str, Any] = bundle[interpreter.CHART_MIME]
    return found


def as_e2b(bundle: dict[str, Any]) -> Any:
    """The result as E2B's SDK builds it from the face's line (``Result(**fields)``)."""
    from e2b_code_interpreter.models import Result as E2BResult

    return E2BResult(**result_fields(Result.from_bundle(bundle, False)))


def test_a_bar_chart_has_its_categories_groups_and_values_and_e2b_types_it() -> None:
    plt.bar(["A", "B"], [100, 200], label="Sold")
    plt.xlabel("Author")
    plt.ylabel("Books [n]")
    plt.title("Sales")
    from e2b_code_interpreter.charts import BarChart

    got = as_e2b(interpreter.figure_bundle(plt.gcf()))
    assert isinstance(got.chart, BarChart) and "chart" in got.formats() and got.png
    assert (got.chart.title, got.chart.x_label, got.chart.y_unit) == ("Sales", "Author", "n")
    assert [(b.label, b.group, b.value) for b in got.chart.elements] == [
        ("A", "Sold", 100),
        ("B", "Sold", 200),
    ]


def test_horizontal_bars_name_their_categories_on_x() -> None:
    plt.barh(["a", "b"], [3, 5])
    plt.xlabel("count")
    plt.ylabel("letter")
    got = chart()
    assert (got["x_label"], got["y_label"]) == ("letter", "count")
    assert got["elements"] == [
        {"label": "a", "group": "Group 0", "value": 3},
        {"label": "b", "group": "Group 0", "value": 5},
    ]


def test_lines_of_dates_on_a_log_scale() -> None:
    day = datetime.date(2024, 5, 1)
    plt.plot([day, day + datetime.timedelta(days=1)], [1.5, 2.5], label="level")
    plt.plot([day, day], [1, 3])  # a vertical rule: no data
    plt.yscale("log")
    plt.xlabel("Day (UTC)")
    got = chart()
    assert (got["type"], got["x_scale"], got["y_scale"], got["x_unit"]) == ("line", "datetime", "log", "UTC")
    assert got["elements"] == [{"label": "level", "points": [["2024-05-01", 1.5], ["2024-05-02", 2.5]]}]
    assert all(datetime.datetime.fromisoformat(t) for t in got["x_ticks"])
    assert len(got["x_tick_labels"]) == len(got["x_ticks"]) and all(
        isinstance(t, float) for t in got["y_ticks"]
    )


def test_a_box_plots_quartiles_whiskers_and_outliers() -> None:
    plt.boxplot([[85, 90, 78, 92, 88], [95, 89, 76, 91, 84, 87]], patch_artist=True)
    plt.xticks([1, 2], ["A", "B"])
    got = chart()
    fields = ("label", "min", "first_quartile", "median", "third_quartile", "max", "outliers")
    assert [tuple(e[f] for f in fields) for e in got["elements"]] == [
        ("A", 78, 85, 88, 90, 92, []),
        ("B", 84, 84.75, 88, 90.5, 95, [76]),
    ]
    plt.close("all")
    plt.boxplot([[1, 2, 3, 4, 50]], orientation="horizontal", patch_artist=True)  # lying: values on x
    (lying,) = chart()["elements"]
    assert (lying["min"], lying["median"], lying["max"], lying["outliers"]) == (1, 3, 4, [50])


def test_pies_scatters_several_axes_and_what_no_rule_reads() -> None:
    plt.pie([90, 10], labels=["yes", "no"], startangle=90)
    assert chart()["elements"] == [
        {"label": "yes", "angle": 324, "radius": 1},
        {"label": "no", "angle": 36, "radius": 1},
    ]
    plt.close("all")
    fig, (left, right) = plt.subplots(1, 2)
    fig.suptitle("Both")
    left.scatter([1, 2], [3, 4], label="dots")
    right.plot([1, 2], ["low", "high"])
    both = chart()
    assert (both["type"], both["title"], [c["type"] for c in both["elements"]]) == (
        "superchart",
        "Both",
        ["scatter", "line"],
    )
    assert both["elements"][0]["elements"] == [{"label": "dots", "points": [[1, 3], [2, 4]]}]
    assert both["elements"][1]["y_scale"] == "categorical"
    plt.close("all")
    plt.gca().add_artist(plt.Circle((0, 0), 1))
    plt.title("circle")
    assert chart() == {"type": "unknown", "title": "circle", "elements": []}
    plt.close("all")
    plt.figure()  # nothing drawn: a picture, no chart
    assert interpreter.CHART_MIME not in interpreter.figure_bundle(plt.gcf())


def test_a_chart_past_its_bound_is_left_out_and_the_picture_stays() -> None:
    plt.plot(range(300_000))
    bundle = interpreter.figure_bundle(plt.gcf())
    assert bundle["image/png"] and interpreter.CHART_MIME not in bundle


def test_values_as_json_has_them() -> None:
    import numpy

    values = (
        numpy.float64(1.5), numpy.int64(2), float("nan"), numpy.datetime64("NaT"),
        numpy.datetime64("2024-01-02T03:04:05", "ns"), datetime.date(2024, 1, 2),
    )  # fmt: skip
    assert [interpreter.plain(v) for v in values] == [1.5, 2, None, None, "2024-01-02T03:04:05", "2024-01-02"]


def test_e2bs_text_of_a_string_is_bare_as_its_interpreter_gives_it() -> None:
    assert as_e2b({"text/plain": "'bar'"}).text == "bar"
    assert as_e2b({"text/plain": '"it\'s"'}).text == "it's"
    assert as_e2b({"text/plain": "('a', 'b')"}).text == "('a', 'b')"  # no string: as it is
    assert as_e2b({"text/plain": "'"}).text == "'"
