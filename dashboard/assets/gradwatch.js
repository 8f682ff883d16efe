/* gradwatch dashboard: clientside callbacks (no server round trip). */

/* plotly.js for dcc.Graph: our own bundle beside this file, plotly.js's core (scatter) and its heatmap
   trace, all the dashboard draws (1.15 MB; the cartesian dist was 1.5 MB, Dash's full one 4.8 MB).
   Compiling and running plotly.js is most of a first visit's wait (docs/performance.md, "Dashboard
   page load"). dcc.Graph loads plotly.js from window._dashPlotlyJSURL when the first chart mounts,
   and the renderer sets that URL when it starts, after this file has run: so it is pinned here.
   dashboard/__init__.py keeps the bundle out of the page's script tags and has browsers cache it
   for a year (its name carries its version). To update it: dashboard/plotly_bundle/build.sh
   <the plotly.js version the installed plotly ships>, then change the name below. */
(function () {
  var me = document.currentScript && document.currentScript.src;
  if (!me) { return; }
  var url = new URL('plotly-scatter-heatmap-4.1.1.min.js', me).href;
  try {
    Object.defineProperty(window, '_dashPlotlyJSURL', {
      configurable: true, get: function () { return url; }, set: function () { /* pinned */ }
    });
  } catch (e) { /* Dash's own (full) bundle then */ }
})();

/* Two changes to plotly.js as dcc.Graph drives it, installed on window.Plotly when plotly.js sets it
   (dcc.Graph loads it when the first chart mounts). Both spare main-thread work that draws nothing new
   (docs/performance.md, "Dashboard page load").

   Resize. dcc.Graph calls Plotly.Plots.resize after a chart's first draw, and again whenever the chart's
   box is observed to resize; plotly then relayouts with autosize, which redoes the chart's defaults and
   draw (and reports a relayout to the page) even when the box has not changed -- on a cold run page,
   ~0.3 s for ~20 charts whose boxes never changed. Skipped here when the box is within plotly's own
   1 px of the size the chart was drawn at: plotly's autosize would change nothing then.

   Placeholders. A chart of the run page mounts with a placeholder figure (layout.meta
   "gw-placeholder": nothing to see, its data comes from a callback), and dcc.Graph draws it on mount:
   ~9 ms of plotly a chart, ~0.2 s for a page of ~20 charts, while the first data is on its way. It is
   not drawn: dcc.Graph gets a resolved promise, and the event handlers it then binds (zoom, hover) are
   kept and handed to plotly's own emitter at the chart's first real draw. The box keeps its height
   from the stylesheet (.gw-chart min-height). */
(function () {
  function node(gd) { return typeof gd === 'string' ? document.getElementById(gd) : gd; }
  function isPlaceholder(figure) { return !!(figure && figure.layout && figure.layout.meta === 'gw-placeholder'); }

  function patchReact(P) {
    if (!P || !P.react || P.react.gradwatch) { return; }
    var react = P.react;
    var deferring = function (gd, figure) {
      var el = node(gd);
      if (el && !el._fullLayout && isPlaceholder(figure)) {
        if (!el._gwPending) {
          var pending = el._gwPending = [];
          el.on = function (name, fn) { pending.push([name, fn]); return el; };
          el.removeAllListeners = function () { pending.length = 0; };
        }
        return Promise.resolve(el);
      }
      var handed = el && el._gwPending;
      if (handed) {           // plotly's first draw makes its own emitter (gd.on & co.)
        delete el._gwPending;
        delete el.on;
        delete el.removeAllListeners;
      }
      var p = react.apply(this, arguments);
      return !handed ? p : p.then(function (out) {
        handed.forEach(function (l) { el.on(l[0], l[1]); });
        return out;
      });
    };
    deferring.gradwatch = true;
    P.react = deferring;
  }

  function patchResize(P) {
    if (!P || !P.Plots || !P.Plots.resize || P.Plots.resize.gradwatch) { return; }
    var resize = P.Plots.resize;
    var skipping = function (gd) {
      var el = node(gd);
      if (el && el._gwPending) { return Promise.resolve(el); }   // a placeholder not drawn: nothing to size
      var fl = el && el._fullLayout;
      if (!fl || !el.layout || !el.isConnected || el.offsetParent === null) { return resize.apply(this, arguments); }
      var cs = window.getComputedStyle(el);
      var w = parseFloat(cs.width), h = parseFloat(cs.height);
      if (Math.abs(w - fl.width) <= 1 && Math.abs(h - fl.height) <= 1) { return Promise.resolve(el); }
      return resize.apply(this, arguments);
    };
    skipping.gradwatch = true;
    P.Plots.resize = skipping;
  }

  function patch(P) { patchReact(P); patchResize(P); }
  var current = window.Plotly;
  patch(current);
  try {
    Object.defineProperty(window, 'Plotly', {
      configurable: true, enumerable: true,
      get: function () { return current; },
      set: function (v) { current = v; patch(v); }
    });
  } catch (e) { /* plotly's own react and resize then */ }
})();

window.dash_clientside = Object.assign({}, window.dash_clientside, {
  gradwatch: {
    /* Zoom one chart, all follow. Inputs: relayoutData of every chart of the
       page, then a reset button's n_clicks; State: the current range store.
       Moves the other charts with Plotly.relayout right away and returns the
       new range ([start, end] or null for the whole run) for the server to
       refetch at full resolution. */
    syncX: function () {
      var args = Array.prototype.slice.call(arguments);
      var current = args[args.length - 1];
      var dc = window.dash_clientside;
      var trig = (dc.callback_context.triggered || [])[0];
      if (!trig) { return dc.no_update; }
      var dot = trig.prop_id.lastIndexOf('.');
      var source = trig.prop_id.slice(0, dot);
      var prop = trig.prop_id.slice(dot + 1);
      var next;
      if (prop === 'n_clicks') {
        next = null;
      } else {
        var rd = trig.value || {};
        if (rd['xaxis.autorange'] === true) {
          next = null;
        } else if (rd['xaxis.range[0]'] !== undefined && rd['xaxis.range[1]'] !== undefined) {
          next = [Number(rd['xaxis.range[0]']), Number(rd['xaxis.range[1]'])];
        } else if (Array.isArray(rd['xaxis.range'])) {
          next = [Number(rd['xaxis.range'][0]), Number(rd['xaxis.range'][1])];
        } else {
          return dc.no_update;  /* autosize, y-only zoom, legend clicks */
        }
      }
      var same = (next === null && (current === null || current === undefined)) ||
        (next !== null && Array.isArray(current) &&
         Math.abs(next[0] - current[0]) < 1e-6 * (1 + Math.abs(current[0])) &&
         Math.abs(next[1] - current[1]) < 1e-6 * (1 + Math.abs(current[1])));
      if (same) { return dc.no_update; }
      var ids = (dc.callback_context.inputs_list || []).map(function (i) { return i.id; })
        .filter(function (id) {
          return typeof id === 'string' && id !== source && (id.indexOf('graph') >= 0 || id.indexOf('heatmap') >= 0);
        });
      ids.forEach(function (id) {
        var el = document.getElementById(id);
        var gd = el && (el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot'));
        if (!gd || !window.Plotly || !gd.layout) { return; }
        var upd = next === null ? {'xaxis.autorange': true} : {'xaxis.range': next.slice(), 'xaxis.autorange': false};
        try { window.Plotly.relayout(gd, upd); } catch (e) { /* a chart not drawn yet follows on its next draw */ }
      });
      return next;
    }
  }
});
