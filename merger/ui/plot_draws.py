"""A script for the page's head: each Plotly figure drawn once per animation frame, where it is still on the page.

Gradio's Plot keys its figure on the value: a new value re-mounts the figure in a new div, after the old
figure has drawn that value in the old div, which goes right after. So a move drew each of the Merge
tab's figures twice, the second time from scratch: 110–140 ms more of the page's main thread per move
on a 2-core machine, beside the next move's forward (docs/performance.md). Here ``Plotly.react`` draws at
the next animation frame (at once in a background tab, whose frames wait) the latest figure asked for
that div, and none in a div no longer on the page. The resize Gradio asks for right after a draw runs
after it, only where the div's width is no longer the one drawn. A figure in a hidden tab is drawn at
once, at Plotly's default width, as before (the landscape tab lays its figure out again when shown).
Draws reach Plotly through ``Plotly.react.original`` and ``Plotly.Plots.resize.original``, Plotly's own
(a bench puts them back to time the page without this)."""
from __future__ import annotations

PLOT_DRAWS_HEAD = """<script>
(() => {
  const drawOncePerFrame = (plotly) => {
    const asked = new Map();
    const later = (fn) => document.hidden ? setTimeout(fn, 0) : requestAnimationFrame(fn);
    const react = function (target, ...args) {
      const div = typeof target === "string" ? document.getElementById(target) : target;
      if (!(div instanceof Element)) return react.original.call(plotly, target, ...args);
      const waiting = asked.get(div);
      if (waiting) {  // one draw this frame, of the latest figure: every caller's promise is that draw's
        waiting.args = args;
        return waiting.drawn;
      }
      const next = {args, resize: false};
      next.drawn = new Promise((resolve, reject) => later(() => {
        asked.delete(div);
        if (!div.isConnected) { resolve(div); return; }
        new Promise((drawn) => drawn(react.original.call(plotly, div, ...next.args))).then((value) => {
          const drawnWidth = div._fullLayout && div._fullLayout.width;
          if (next.resize && drawnWidth && Math.round(div.getBoundingClientRect().width) !== Math.round(drawnWidth)) {
            resize.original.call(plotly.Plots, div);
          }
          resolve(value);
        }, reject);
      }));
      asked.set(div, next);
      return next.drawn;
    };
    const resize = (div) => {
      const waiting = asked.get(div);
      if (!waiting) return resize.original.call(plotly.Plots, div);
      waiting.resize = true;
      return waiting.drawn;
    };
    react.original = plotly.react;
    resize.original = plotly.Plots.resize;
    plotly.react = react;
    plotly.Plots.resize = resize;
  };
  const fits = (value) => value && value.react && value.Plots && !value.react.original;
  let plotly = window.Plotly;
  if (fits(plotly)) drawOncePerFrame(plotly);
  Object.defineProperty(window, "Plotly", {configurable: true, enumerable: true, get: () => plotly, set: (value) => {
    if (value !== plotly && fits(value)) drawOncePerFrame(value);
    plotly = value;
  }});
})();
</script>"""
