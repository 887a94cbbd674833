"""The History tab: every evaluated spec (SQLite), filtered, reloaded into the Merge tab, exported as CSV."""
from __future__ import annotations


import gradio as gr

from merger import methods
from merger.ui.errors import fail


class HistoryTab:
    def __init__(self, ctl):
        self.ctl = ctl

    HISTORY_HEADERS = ["id", "time", "method", "params", "experts", "split", "forward", "avg acc %", "normalised %",
                       "loss"]
    # Set widths, or the table sizes each column to its longest text and scrolls sideways (7 experts)
    COLUMN_WIDTHS = ["4%", "11%", "12%", "19%", "19%", "6%", "6%", "8%", "9%", "6%"]

    def history_rows(self, method_filter="", text=""):
        if self.ctl.history is None:
            return []
        rows = self.ctl.history.rows(method=method_filter or None, pool=self.ctl.pool_ref, text=_searched(text))
        # ", " between experts: the table wraps a long list there instead of scrolling sideways
        # forward: the forwards' precision; "?" on a row written before it was recorded
        return [[r["id"], r["time"], r["method"], r["params"], r["experts"].replace(",", ", "), r["split"],
                 r["forward"] or "?", round(100 * r["average_accuracy"], 2),
                 None if r["normalized_accuracy"] is None else round(100 * r["normalized_accuracy"], 2),
                 round(r["average_loss"], 4)] for r in rows]

    @staticmethod
    def picked_id(evt: gr.SelectData):
        """The id of the row a click landed on, for the reload box (the table's first column)."""
        row = evt.row_value or []
        return str(row[0]) if row and row[0] not in (None, "") else gr.update()

    def history_csv(self, method_filter="", text=""):
        if self.ctl.history is None:
            fail("history is off")
        out = self.ctl.downloads.fresh("history.csv")
        return str(self.ctl.history.export_csv(out, method=method_filter or None, pool=self.ctl.pool_ref,
                                               text=_searched(text)))


def _searched(text) -> str | None:
    """The filter's text, a method's shown name ("TIES-merging") read as its recorded one ("ties")."""
    text = (text or "").strip()
    by_shown = {m.display_name.lower(): m.name for m in methods.all_methods()}
    return by_shown.get(text.lower(), text) or None


def build_history_tab(ctl, events, merge: dict) -> HistoryTab:
    tab = HistoryTab(ctl)
    with gr.Tab("History", id="history") as history_tab:
        with gr.Row():
            hist_method = gr.Dropdown([("all methods", "")] + methods.names(), value="", label="method")
            hist_text = gr.Textbox(label="filter (method, parameters or experts contain)")
            hist_refresh = gr.Button("Refresh")
        hist_table = gr.Dataframe(headers=HistoryTab.HISTORY_HEADERS, interactive=False, wrap=True,
                                  column_widths=HistoryTab.COLUMN_WIDTHS)
        with gr.Row():
            # A text box: Gradio's number box shows an empty value as 0, which is no row
            hist_id = gr.Textbox(label="row id to reload into the Merge tab", placeholder="the table's first column")
            hist_reload = gr.Button("Reload")
            hist_csv_btn = gr.Button("Export CSV")
        hist_file = gr.File(label="history CSV", interactive=False)
        for trig in (hist_refresh.click, hist_method.change, hist_text.submit, history_tab.select):
            trig(tab.history_rows, [hist_method, hist_text], hist_table, api_visibility="private")
        hist_table.select(tab.picked_id, None, hist_id, api_visibility="private")
        hist_reload.click(events.reload, [hist_id, *merge["inputs"]], merge["inputs"], api_visibility="private")
        hist_csv_btn.click(tab.history_csv, [hist_method, hist_text], hist_file, api_visibility="private")
    return tab
