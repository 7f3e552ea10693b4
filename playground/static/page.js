(() => {
  const PROMPTS = __PROMPTS__;
  // The page's one global, shared with the js= snippets (playground/static/*.js): window.dp.
  window.dp = window.dp || {};
  // The page's owner secret (views/step.py's StepSession), made here, before Gradio mounts anything:
  // every event that carries it fills it in as it is sent (page_owner.js), so the first click after
  // load carries the same owner as the startup example's poll, with no answer to wait for.
  window.dp.owner = window.dp.owner || Array.from(crypto.getRandomValues(new Uint8Array(16)),
                                                  b => b.toString(16).padStart(2, '0')).join('');
  // The element ``selector`` names inside element ``id`` (an id from playground/ids.py).
  const inside = (id, selector) => document.querySelector('#' + id + ' ' + selector);
  const visible = el => el && el.offsetParent !== null;
  // A lesson link (?lesson=...): the page is built with the first lesson in the Lessons tab, and the
  // link's lesson comes with the page's load event (views/lessons.py on_query; its answer removes
  // this class). Until then no lesson's text shows (page.css) and Open, Run and the presenter's Run
  // ignore clicks and keys, so the only lesson shown or run is the link's.
  if (new URLSearchParams(window.location.search).has(__LESSON_PARAM__)) {
    document.documentElement.classList.add('dp-lesson-pending');
    document.addEventListener('click', e => {
      if (!document.documentElement.classList.contains('dp-lesson-pending')) return;
      const held = [__ID_LESSONS_OPEN__, __ID_LESSONS_RUN__, __ID_PRESENT_RUN__].map(id => '#' + id).join(', ');
      if (e.target.closest && e.target.closest(held)) { e.preventDefault(); e.stopImmediatePropagation(); }
    }, true);
  }
  document.addEventListener('keydown', e => {
    const t = e.target;
    if ((e.ctrlKey || e.metaKey) && e.key === 'Enter' && t.tagName === 'TEXTAREA') {
      const box = t.closest('[id]');
      const button = box && PROMPTS[box.id] && document.getElementById(PROMPTS[box.id]);
      if (button) { e.preventDefault(); e.stopPropagation(); button.click(); }
      return;
    }
    if (['ArrowLeft', 'ArrowRight', 'Enter'].includes(e.key) && !['INPUT', 'TEXTAREA', 'SELECT'].includes(t.tagName)) {
      const text = document.getElementById(__ID_STEP_TEXT__);
      if (!visible(text)) return;
      const tokens = [...text.querySelectorAll('.token')];
      if (e.key === 'Enter') {
        if (t.classList && t.classList.contains('token')) { e.preventDefault(); t.click(); }
        return;
      }
      if (t !== document.body && !text.contains(t)) return;
      const box = inside(__ID_STEP_INDEX__, 'input[type=number]');
      const at = box ? Number(box.value) : 0;
      const next = Math.max(0, Math.min(tokens.length - 1, at + (e.key === 'ArrowRight' ? 1 : -1)));
      if (tokens[next]) { e.preventDefault(); tokens[next].click(); tokens[next].focus(); }
    }
  }, true);
  // Presenter, Step through and Lessons: the page width goes into a hidden width box (its change redraws the
  // chart for that width); a chart laid out for the other width (e.g. the lesson's run draws it wide)
  // is redrawn once, by the hidden redraw button.
  const setValue = (box, value) => {
    const setter = Object.getOwnPropertyDescriptor(Object.getPrototypeOf(box), 'value').set;
    setter.call(box, value);
    box.dispatchEvent(new Event('input', {bubbles: true}));
  };
  const fitWidth = (widthId, chartId, redrawId) => {
    const box = inside(widthId, 'input');
    if (!box) return;
    const want = String(Math.round(window.innerWidth));
    if (box.value !== want) { setValue(box, want); return; }
    const plot = inside(chartId, '.js-plotly-plot');
    const meta = plot && plot.layout && plot.layout.meta;
    const stale = meta && (meta.narrow !== (window.innerWidth < __NARROW__)
                           || (meta.phone !== undefined && meta.phone !== (window.innerWidth < __PHONE__)));
    if (stale && plot.dataset.dpAsked !== want) {
      plot.dataset.dpAsked = want;
      document.getElementById(redrawId)?.click();
    }
  };
  // A chart that carries a phone layout (layout.meta.layouts: playground/charts/compare.py's
  // with_phone_layout; the Lessons tab's and Compare's inspector's, whose views do not know the
  // page width) gets the layout its box's width needs, swapped in place (no request).
  const fitLayouts = () => {
    if (!window.Plotly) return;
    document.querySelectorAll('.js-plotly-plot').forEach(plot => {
      const meta = plot.layout && plot.layout.meta;
      const layouts = meta && meta.layouts;
      const width = plot.getBoundingClientRect().width;
      if (!layouts || !width) return;  // a hidden tab's chart has no width yet
      const want = width < layouts.below ? 'phone' : 'wide';
      if (meta.shown === want) return;
      window.Plotly.react(plot, plot.data, {...layouts[want], template: plot.layout.template, meta: {...meta, shown: want}});
    });
  };
  // A table or the beam tree wider than its box scrolls sideways inside it: app.css says so above it
  // and shades the right edge while more lies beyond it. A new beam tree is scrolled to the end of its
  // winning path (layout.meta.scroll_to, px), where the finished hypotheses are.
  // (box, what scrolls in it: the first of these that is wider than it; a phone's CSS lets the
  // plot's inner container scroll instead of Gradio's box)
  const SCROLLERS = [['.table-wrap', '.virtual-table-viewport'],
                     ['#' + __ID_BEAM_TREE__, '[data-testid=plotly], [data-testid=plotly] .plot-container']];
  const flag = (el, name, on) => { if (el.hasAttribute(name) !== on) el.toggleAttribute(name, on); };
  const toWinner = view => {
    const plot = view.closest('.js-plotly-plot') || view.querySelector('.js-plotly-plot');  // Gradio's box is the plot
    const to = plot && plot.layout && plot.layout.meta && plot.layout.meta.scroll_to;
    if (!plot || view.dpLayout === plot.layout) return;
    view.dpLayout = plot.layout;  // once per drawn tree: a person's own scrolling is left alone
    if (typeof to === 'number') view.scrollLeft = Math.max(0, to - view.clientWidth + 80);
  };
  const markTables = () => SCROLLERS.forEach(([outer, inner]) => document.querySelectorAll(outer).forEach(box => {
    const views = [...box.querySelectorAll(inner)];
    const view = views.find(v => v.scrollWidth > v.clientWidth + 1) || views[0];
    if (!view || !view.clientWidth) return;  // a hidden tab's
    if (inner !== '.virtual-table-viewport') toWinner(view);
    flag(box, 'data-dp-scrolls', view.scrollWidth > view.clientWidth + 1);
    flag(box, 'data-dp-end', view.scrollLeft + view.clientWidth >= view.scrollWidth - 1);
  }));
  document.addEventListener('scroll', markTables, true);
  const presentWidth = () => {
    fitWidth(__ID_PRESENT_WIDTH__, __ID_PRESENT_CHART__, __ID_PRESENT_REDRAW__);
    fitWidth(__ID_STEP_WIDTH__, __ID_STEP_CHART__, __ID_STEP_REDRAW__);
    fitWidth(__ID_LESSONS_WIDTH__, __ID_LESSONS_CHART__, __ID_LESSONS_REDRAW__);
    fitLayouts();
    markTables();
  };
  window.addEventListener('resize', presentWidth);
  // Step through's selected step: its token is outlined (the step box holds the selected index).
  const markSelected = () => {
    const box = inside(__ID_STEP_INDEX__, 'input[type=number]');
    const at = box ? Number(box.value) : -1;
    document.querySelectorAll('#' + __ID_STEP_TEXT__ + ' .token').forEach((el, i) => {
      const on = i === at;
      if (el.classList.contains('dp-selected') !== on) el.classList.toggle('dp-selected', on);
      if (on && el.getAttribute('aria-current') !== 'true') el.setAttribute('aria-current', 'true');
      if (!on && el.hasAttribute('aria-current')) el.removeAttribute('aria-current');
    });
  };
  // The QR code in the presenter view: a click enlarges it for the room, another shrinks it back.
  document.addEventListener('click', e => {
    const code = e.target.closest && e.target.closest('#' + __ID_PRESENT_QR__);
    if (code) code.classList.toggle('dp-qr-big');
  });
  // Tokens take the keyboard focus (Tab, then Enter opens a token's step).
  new MutationObserver(() => {
    document.querySelectorAll('#' + __ID_STEP_TEXT__ + ' .token:not([tabindex])').forEach(el => el.setAttribute('tabindex', '0'));
    presentWidth();
    markSelected();
  }).observe(document.documentElement, {childList: true, subtree: true});
  // The step box's value is set as a property (no DOM mutation when only it changes): look again.
  setInterval(() => { markSelected(); markTables(); }, 250);

  // The sortable stage list writes its order into the hidden textbox named by data-target.
  const commit = ol => {
    const box = document.querySelector('#' + ol.dataset.target + ' textarea, #' + ol.dataset.target + ' input');
    if (!box) return;
    const setter = Object.getOwnPropertyDescriptor(Object.getPrototypeOf(box), 'value').set;
    setter.call(box, [...ol.children].map(li => li.dataset.stage).join(', '));
    window.dp.stageEdit = true;  // a person's edit: the preset note says modified (knobs.STAGE_MODIFIED_JS)
    box.dispatchEvent(new Event('input', {bubbles: true}));
  };
  let dragged = null;
  document.addEventListener('dragstart', e => {
    const li = e.target.closest && e.target.closest('.dp-stages li');
    if (li) { dragged = li; e.dataTransfer.effectAllowed = 'move'; e.dataTransfer.setData('text/plain', li.dataset.stage); }
  });
  document.addEventListener('dragover', e => {
    if (dragged && e.target.closest && e.target.closest('.dp-stages')) e.preventDefault();
  });
  document.addEventListener('drop', e => {
    const li = e.target.closest && e.target.closest('.dp-stages li');
    if (!dragged || !li || li === dragged || li.parentNode !== dragged.parentNode) { dragged = null; return; }
    e.preventDefault();
    const r = li.getBoundingClientRect();
    li.parentNode.insertBefore(dragged, e.clientY > r.top + r.height / 2 ? li.nextSibling : li);
    commit(li.parentNode);
    dragged = null;
  });
  document.addEventListener('click', e => {
    const b = e.target.closest && e.target.closest('.dp-stages button');
    if (!b) return;
    const li = b.closest('li'), ol = li.parentNode;
    if (b.classList.contains('dp-up') && li.previousElementSibling) ol.insertBefore(li, li.previousElementSibling);
    else if (b.classList.contains('dp-down') && li.nextElementSibling) ol.insertBefore(li.nextElementSibling, li);
    else return;
    commit(ol);
  });

  // A slider's number box: an out-of-range value is refused with the typed value named, and the box
  // goes back to its last in-range value before Gradio sees the change (Gradio would clamp it: T 999
  // would run as 5 without a word). The last value is noted when the box takes the focus.
  const knobBox = t => t && t.tagName === 'INPUT' && t.type === 'number' && t.closest('.dp-knob-slider');
  document.addEventListener('focusin', e => { if (knobBox(e.target)) e.target.dataset.dpLast = e.target.value; }, true);
  document.addEventListener('change', e => {
    const t = e.target;
    if (!knobBox(t)) return;
    const v = Number(t.value), lo = Number(t.min), hi = Number(t.max);
    const holder = t.closest('.dp-knob-slider');
    let note = holder.querySelector('.dp-refused');
    if (t.value !== '' && (v < lo || v > hi)) {
      if (!note) { note = document.createElement('div'); note.className = 'dp-refused dp-error'; note.setAttribute('role', 'alert'); holder.appendChild(note); }
      const name = (holder.id || '').replace(/^.*knob-/, '');
      note.textContent = `⚠ ${name}: ${t.value} is out of range [${t.min}, ${t.max}]; not applied, the value stays ${t.dataset.dpLast ?? 'as it was'}`;
      if (t.dataset.dpLast !== undefined && t.dataset.dpLast !== '') setValue(t, t.dataset.dpLast);
    } else if (note) { note.remove(); }
  }, true);
})();
