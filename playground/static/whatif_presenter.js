async (key, model, quantization, width, temperature) => {
  const label = document.querySelector('#' + __ID_PRESENT_TEXT__ + ' .dp-present-label');
  if (!key || !label || label.dataset.hidden === '1') return;
  const step = Number(label.dataset.step);
  const seq = window.dp.presentSeq = (window.dp.presentSeq || 0) + 1;
  const chart = window.dp.presentChartSeq;  // the chart this answer is for (whatif_presenter_prepare.js counts)
  let reply;
  try {
    const res = await (__POST__)({view: 'presenter', key, step, model, quantization, width, knobs: {temperature}});
    reply = await res.json();
  } catch (err) {
    return;
  }
  // A later move is on its way, or a new run or step replaced the chart meanwhile: not drawn.
  if (seq !== window.dp.presentSeq || chart !== window.dp.presentChartSeq || !reply.figure) return;
  (__DRAW_INTO__)('#' + __ID_PRESENT_CHART__ + ' .js-plotly-plot', () => {
    const now = document.querySelector('#' + __ID_PRESENT_TEXT__ + ' .dp-present-label');
    return now && now.dataset.hidden !== '1' ? Number(now.dataset.step) : -1;
  })(reply.figure);
}
