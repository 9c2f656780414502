// Point require.js at the local copy of anywidget's AMD module (_static/dpa-assets/anywidget.js),
// so that the ipywidgets html-manager renders anywidgets from saved state without a CDN.
(function () {
  var here = document.currentScript.src;
  var base = here.substring(0, here.lastIndexOf("/") + 1) + "dpa-assets/";
  window.requirejs.config({ paths: { anywidget: base + "anywidget" } });
})();
