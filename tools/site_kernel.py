"""Run by every kernel ``tools/make_site.py`` starts (as its ``PYTHONSTARTUP`` file): each
matplotlib figure a cell displays carries its title as the PNG's ``alt`` metadata, which the
site writes into the page's ``<img alt=...>``.

The title is read when the figure is displayed (``plt.show()``, the inline backend's flush at
the end of a cell, or ``display(fig)`` inside a widget's Output), so it is the title drawn.
A mimebundle formatter (not the PNG one) is used because matplotlib's inline backend registers
its own PNG formatter again whenever it is selected; this one returns no data, only metadata.

Imported as a module (tests), it only defines :func:`figure_title`.
"""

def figure_title(fig) -> str:
    """What a figure shows, in words: its suptitle and each axes' title, else its axes' labels.

    Args:
        fig: a ``matplotlib.figure.Figure``.
    Returns:
        The titles joined by "; " (duplicates once), or "figure" when it has neither.
    """
    parts = []
    if fig.get_suptitle():
        parts.append(fig.get_suptitle())
    for ax in fig.axes:
        parts += [t for t in (ax.get_title("left"), ax.get_title(), ax.get_title("right")) if t]
    if not parts:  # an untitled plot: what is plotted against what
        parts = [f"{ax.get_ylabel()} against {ax.get_xlabel()}" if ax.get_xlabel() else ax.get_ylabel()
                 for ax in fig.axes if ax.get_ylabel() or ax.get_xlabel()]
    text = "; ".join(dict.fromkeys(" ".join(p.split()) for p in parts))
    return text or "figure"


def _register_alt_text(ip, title=figure_title) -> None:
    ip.display_formatter.mimebundle_formatter.for_type_by_name(
        "matplotlib.figure", "Figure", lambda fig: ({}, {"image/png": {"alt": title(fig)}}))


if __name__ == "__main__" and "get_ipython" in globals():  # PYTHONSTARTUP, in the kernel's namespace
    _register_alt_text(get_ipython())  # noqa: F821 -- IPython puts get_ipython in that namespace
    # the lesson's namespace stays the lesson's: the formatter keeps its own reference
    del figure_title, _register_alt_text
