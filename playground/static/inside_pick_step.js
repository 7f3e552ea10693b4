() => {
  // Inside the model, after each run's entropy chart is drawn: the page width goes into a hidden box (the
  // picked step's stage chart is laid out for it), and a click on a step of the chart (a hesitation star,
  // or any other step) puts that step into the hidden pick box, whose change draws the step's stage chart.
  const inside = (id, selector) => document.querySelector('#' + id + ' ' + selector);
  const put = (box, value) => {
    const setter = Object.getOwnPropertyDescriptor(Object.getPrototypeOf(box), 'value').set;
    setter.call(box, value);
    box.dispatchEvent(new Event('input', {bubbles: true}));
  };
  const width = inside(__ID_INSIDE_WIDTH__, 'input');
  if (width && width.value !== String(Math.round(window.innerWidth))) put(width, String(Math.round(window.innerWidth)));
  let tries = 0;
  const attach = () => {
    // The chart is drawn after this event (this script runs on each change): each plot gets one listener,
    // and the polling ends once it has it.
    const plot = inside(__ID_INSIDE_OVER_RUN__, '.js-plotly-plot');
    if (plot && typeof plot.on === 'function' && !plot.dpPick) {
      plot.dpPick = true;
      plot.on('plotly_click', (event) => {
        const point = event && event.points && event.points[0];
        const box = inside(__ID_INSIDE_PICK__, 'input');
        if (point && box && Number.isInteger(point.x)) put(box, String(point.x));
      });
    }
    else if (!(plot && plot.dpPick) && ++tries < 40) setTimeout(attach, 250);  // not drawn yet: look again
  };
  attach();
}
