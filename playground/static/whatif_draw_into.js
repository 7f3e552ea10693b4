(plotSelector, step) => (fig) => {
  const plot = document.querySelector(plotSelector);
  if (!fig || !plot || !window.Plotly) return;
  const shown = fig.layout.meta ? fig.layout.meta.step : undefined;
  const now = step();
  if (now !== undefined && shown !== undefined && now !== shown) return;  // another step was selected meanwhile
  fig.layout.autosize = true;
  fig.layout.margin = fig.layout.margin || {};
  if (fig.layout.title) fig.layout.margin.t = Math.max(100, fig.layout.margin.t || 0);
  fig.layout.margin.autoexpand = true;
  window.Plotly.react(plot, fig.data, fig.layout, Object.assign({}, fig.config || {}, {responsive: true}));
}
