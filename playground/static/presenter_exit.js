() => { document.querySelector('#lessons-present input')?.click(); }
